//! Build script: with the `python` feature, points the run-time loader at the
//! libpython of the interpreter the build was configured for, records that
//! interpreter for the runtime, and passes it on to dependents.
//!
//! Without an rpath the loader may resolve `libpython3.X.so` to another copy
//! of the same minor version (e.g. the system one) whose site-packages lack
//! cloudpickle; the symptom is a `ModuleNotFoundError` at run time and no
//! link error. The interpreter is `PYO3_PYTHON` (an absolute path) if set,
//! else `python3` on `PATH`.
//!
//! The rpath only applies to this package's own binaries, tests and examples.
//! A dependent's binaries get it from the dependent's build script, which
//! reads what this one publishes through the `links = "callreg"` key:
//!
//! * `DEP_CALLREG_PYTHON_LIBDIR`: the directory of the libpython the build
//!   linked (add it as the dependent's rpath);
//! * `DEP_CALLREG_PYTHON`: the interpreter the build was configured for.
//!
//! The runtime (`PythonRuntime::start`) gets the same two values as
//! `CALLREG_BUILD_PYTHON` and `CALLREG_BUILD_LIBPYTHON_DIR` (compile-time
//! environment), to start that interpreter's configuration (its
//! site-packages, a virtual environment's included) and to refuse a
//! different libpython.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "python")]
    if std::env::var_os("CARGO_FEATURE_PYTHON").is_some() {
        pyo3_build_config::add_libpython_rpath_link_args();
        // `Py_LIMITED_API` when built for the stable ABI (the `callreg`
        // Python package's abi3 extension): the embedded interpreter's
        // configuration API is not part of it.
        pyo3_build_config::use_pyo3_cfgs();
        let config = pyo3_build_config::get();
        let executable = config.executable().unwrap_or_default().to_owned();
        let lib_dir = if config.shared() {
            config.lib_dir().unwrap_or_default().to_owned()
        } else {
            // A static libpython is part of the binary: nothing to locate.
            String::new()
        };
        println!("cargo:rustc-env=CALLREG_BUILD_PYTHON={executable}");
        println!("cargo:rustc-env=CALLREG_BUILD_LIBPYTHON_DIR={lib_dir}");
        println!("cargo:python={executable}");
        println!("cargo:python_libdir={lib_dir}");
    }
}

//! Build script: with the `python` feature, points the run-time loader at the
//! libpython of the interpreter the build was configured for.
//!
//! Without an rpath the loader may resolve `libpython3.X.so` to another copy
//! of the same minor version (e.g. the system one) whose site-packages lack
//! cloudpickle; the symptom is a `ModuleNotFoundError` at run time and no
//! link error. The interpreter is `PYO3_PYTHON` (an absolute path) if set,
//! else `python3` on `PATH`.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "python")]
    if std::env::var_os("CARGO_FEATURE_PYTHON").is_some() {
        pyo3_build_config::add_libpython_rpath_link_args();
    }
}

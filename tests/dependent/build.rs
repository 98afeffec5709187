//! The recipe for a program that depends on callreg with feature `python`:
//! give the binary the RUNPATH of the libpython callreg was built against,
//! which callreg's build script publishes as `DEP_CALLREG_PYTHON_LIBDIR`
//! (empty for a static libpython). Without it the loader may pick another
//! libpython of the same minor version, and the targets refuse to start
//! (`LibpythonMismatch`).

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_CALLREG_PYTHON_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_CALLREG_PYTHON_LIBDIR") {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}

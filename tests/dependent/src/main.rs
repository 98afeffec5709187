//! `callreg-dependent ENVELOPE`: starts 2 Python targets, registers the
//! envelope (a callable taking no argument), runs it on target 1 and prints
//! its JSON result. Exit status 0 on success, 1 with the error on stderr.

use std::process::ExitCode;
use std::sync::Arc;

use callreg::io::Worker;
use callreg::protocol::TargetId;
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;

fn main() -> ExitCode {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: callreg-dependent ENVELOPE");
        return ExitCode::from(2);
    };
    match run(&path) {
        Ok(result) => {
            println!("{result}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: &std::ffi::OsStr) -> Result<String, Box<dyn std::error::Error>> {
    let envelope = std::fs::read(path)?;
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(2)
        .build()?;
    worker.start()?;
    let handle = worker.register(&envelope)?;
    let result = worker.submit(&handle, TargetId(1), TaskEncoding::Json, b"{}")?;
    worker.close();
    Ok(String::from_utf8(result)?)
}

//! Running the `probespec` binary: one command builder, one result type, and the ways a run must end.

use std::io::Write;
use std::process::{Command, ExitStatus, Stdio};

/// The binary with `args`, stdin closed, `PROBESPEC_MODEL_DIR` pointing nowhere, so that no test reads
/// the user's default model by accident (tests of the default model pass `--model`), and
/// [`NO_COST_CACHE`] as the cost cache, so that no test writes a cost curve anywhere. Add environment
/// variables on the returned command, then [`run`] it.
pub fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_probespec"));
    cmd.args(args)
        .env("PROBESPEC_MODEL_DIR", "/nonexistent-probespec-model-dir")
        .env("PROBESPEC_COST_DIR", NO_COST_CACHE)
        .stdin(Stdio::null());
    cmd
}

/// A cost-cache folder that cannot be created, even by root (a path under a device file): `--bc auto`
/// times its curve in every process and keeps it nowhere.
pub const NO_COST_CACHE: &str = "/dev/null/probespec-no-cost-cache";

/// What a run of the binary did.
#[derive(Debug)]
pub struct Run {
    /// The command line, for failure messages.
    pub args: Vec<String>,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` to the end, feeding it `stdin` when given; stdout and stderr must be UTF-8.
pub fn run(cmd: &mut Command, stdin: Option<&[u8]>) -> Run {
    let args: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    if stdin.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Fed from a thread, so that a child writing much before it reads cannot block on us; a child that
    // exits without reading (a refused invocation) closes the pipe, which is no failure of the run.
    let feeder = stdin.map(|bytes| {
        let mut pipe = child.stdin.take().unwrap();
        let bytes = bytes.to_vec();
        std::thread::spawn(move || match pipe.write_all(&bytes) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("cannot feed stdin: {e}"),
            _ => {}
        })
    });
    let out = child.wait_with_output().unwrap();
    if let Some(f) = feeder {
        f.join().unwrap();
    }
    Run {
        stdout: String::from_utf8(out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not UTF-8: {e}")),
        stderr: String::from_utf8(out.stderr)
            .unwrap_or_else(|e| panic!("{args:?}: stderr is not UTF-8: {e}")),
        status: out.status,
        args,
    }
}

/// `probespec ARGS` with stdin closed.
pub fn probespec(args: &[&str]) -> Run {
    run(&mut command(args), None)
}

/// `probespec ARGS` reading `stdin`.
pub fn probespec_stdin(args: &[&str], stdin: &[u8]) -> Run {
    run(&mut command(args), Some(stdin))
}

impl Run {
    /// The exit status, -1 when a signal ended the process.
    pub fn code(&self) -> i32 {
        self.status.code().unwrap_or(-1)
    }

    /// Fails unless the run succeeded, with its stderr.
    pub fn ok(self) -> Run {
        assert!(
            self.status.success(),
            "{:?} failed: {}\nstderr:\n{}",
            self.args,
            self.status,
            self.stderr
        );
        self
    }

    /// A run that must fail (bad flags included, which clap ends with status 2): non-zero exit, no panic,
    /// exactly one line on stderr, containing `needle`.
    pub fn fails_with(&self, needle: &str) {
        let (args, err) = (&self.args, &self.stderr);
        assert_ne!(self.code(), 0, "{args:?} succeeded");
        assert!(
            !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
            "{args:?} panicked: {err}"
        );
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: expected one line, got: {err}"
        );
        assert!(err.contains(needle), "{args:?}: expected '{needle}' in: {err}");
    }

    /// A run that must end in an error of the program (not of the flags): exit status 1, no panic, exactly
    /// one line on stderr, `error: ` first and containing `needle` (any error when empty).
    pub fn errors_with(&self, needle: &str) {
        let (args, err) = (&self.args, &self.stderr);
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert_eq!(self.code(), 1, "{args:?}: exit status {}: {err}", self.code());
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: expected one line, got: {err}"
        );
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: expected '{needle}' in: {err}");
    }
}

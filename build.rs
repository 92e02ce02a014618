//! Records the git commit the binary is built from (`PROBESPEC_GIT_COMMIT`, "+dirty" with uncommitted
//! changes; what `bench` writes in its run settings). With the `cuda` feature: compiles the row-invariant
//! CUDA kernels (src/kernels/cuda/exact.cu) to PTX with nvcc, for the compute capability in
//! CUDA_COMPUTE_CAP (default 90: H100 / H200).
use std::{env, path::PathBuf, process::Command};

/// The short commit of the source tree, "+dirty" when tracked files differ from it; "unknown" without git.
fn git_commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(commit) if !commit.is_empty() => {
            let dirty =
                git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{commit}+dirty")
            } else {
                commit
            }
        }
        _ => "unknown".into(),
    }
}

fn main() {
    // Run again when a commit is made or checked out (the reflog), the index or any source file changes.
    for git_path in ["logs/HEAD", "index"] {
        let out = Command::new("git")
            .args(["rev-parse", "--git-path", git_path])
            .output();
        if let Some(o) = out.ok().filter(|o| o.status.success() && !o.stdout.is_empty()) {
            println!(
                "cargo:rerun-if-changed={}",
                String::from_utf8_lossy(&o.stdout).trim()
            );
        }
    }
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rustc-env=PROBESPEC_GIT_COMMIT={}", git_commit());
    let source = "src/kernels/cuda/exact.cu";
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("exact.ptx");
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let status = Command::new("nvcc")
        .args(["--ptx", "-O3", &format!("-arch=sm_{cap}"), source, "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("the cuda feature needs nvcc on PATH: {e}"));
    assert!(status.success(), "nvcc failed on {source}");
}

//! With the `cuda` feature: compiles the row-invariant CUDA kernels (src/kernels/cuda/exact.cu) to PTX
//! with nvcc, for the compute capability in CUDA_COMPUTE_CAP (default 90: H100 / H200). Nothing otherwise.
use std::{env, path::PathBuf, process::Command};

fn main() {
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

//! Machine and build facts for records and cache keys: CPU model, threads, GPU name, git commit, UTC date,
//! the exact command line, and a stable fingerprint of bytes. Every probe degrades to "unknown" rather
//! than failing a run.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// The CPU model from /proc/cpuinfo ("model name", or "Model"/"Hardware" on ARM boards).
pub fn cpu_model() -> String {
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return "unknown".into();
    };
    for key in ["model name", "Model", "Hardware", "cpu model"] {
        if let Some(v) = info.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_string())
        }) {
            return v;
        }
    }
    "unknown".into()
}

/// The threads the kernels run on: the kernel pool's (`--threads`, else `RAYON_NUM_THREADS`, else one
/// per core), not the machine's cores.
pub fn threads() -> usize {
    crate::kernels::pool::Pool::global().threads()
}

/// First line of a command's stdout, if it ran and succeeded.
fn first_line(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .to_string();
    (!s.is_empty()).then_some(s)
}

/// Name of CUDA device 0, from nvidia-smi when it is installed.
pub fn gpu_name() -> Option<String> {
    first_line(Command::new("nvidia-smi").args(["--query-gpu=name", "--format=csv,noheader", "-i", "0"]))
}

/// The short commit of the source this binary was built from, "+dirty" when it had uncommitted changes
/// (recorded by build.rs when the binary was built, not asked of the repository at run time).
pub fn git_commit() -> String {
    env!("PROBESPEC_GIT_COMMIT").to_string()
}

/// The command line, each argument shell-quoted when it needs to be, so it can be pasted back.
pub fn command_line() -> String {
    std::env::args()
        .map(|a| {
            let plain = !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+%".contains(c));
            if plain {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Now as an RFC 3339 UTC timestamp, e.g. 2026-01-31T12:00:00Z.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    utc_date(secs)
}

/// Seconds since the epoch as an RFC 3339 UTC timestamp, to avoid a date dependency for one line of the
/// summary (the calendar arithmetic is the chat template's `strftime_now`'s).
pub fn utc_date(secs: u64) -> String {
    let rem = secs % 86_400;
    let (year, month, day) = crate::tokenizer::template::civil_from_days((secs / 86_400) as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// FNV-1a 64: a stable content fingerprint without a hashing dependency (std's hasher is not stable
/// across Rust releases).
pub fn fnv1a_hex(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(utc_date(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_date(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_date(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}

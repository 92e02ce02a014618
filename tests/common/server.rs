//! `probespec serve` in a child process on an ephemeral loopback port, and a small HTTP client for it
//! (ureq): JSON requests, streamed answers as server-sent events, the health counters.

use super::binary;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running server; killed when dropped.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// Everything the server printed on stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// `probespec serve --port 0 ARGS`, with `envs` set; waits until it listens.
    pub fn start_with_env(args: &[&str], envs: &[(&str, &str)]) -> Server {
        let mut all = vec!["serve", "--port", "0"];
        all.extend_from_slice(args);
        let mut cmd = binary::command(&all);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start probespec serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(at) = line.find("listening on http://") {
                    let _ = tx.send(line[at + "listening on ".len()..].trim().to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(b) => b,
            Err(_) => {
                let _ = child.kill();
                panic!("probespec serve {args:?} did not start:\n{}", log.lock().unwrap());
            }
        };
        Server { child, base, log }
    }

    pub fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `host:port`, for raw connections.
    pub fn addr(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    /// The server's resident memory in MiB (Linux).
    pub fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status");
        kb / 1024.0
    }

    /// `GET /health`.
    pub fn health(&self) -> Value {
        let (status, body) = get(&self.url("/health"), None);
        assert_eq!(status, 200, "{body}");
        body
    }

    /// Polls /health until `pred` holds (at most 60 s).
    pub fn wait_health(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let t = Instant::now();
        loop {
            let h = self.health();
            if pred(&h) {
                return h;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "waited 60 s for {what}: {h}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `POST path` with a JSON body; the status and the JSON answer (200 expected unless checked).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post_raw(&self.url(path), &body.to_string(), None)
    }

    /// A 200 answer of `POST path`.
    pub fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body);
        assert_eq!(status, 200, "POST {path} {body}: {v}");
        v
    }

    /// A streamed answer: the `data:` payloads in order, `[DONE]` last (checked).
    pub fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let response = agent()
            .post(&self.url(path))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .unwrap_or_else(|e| panic!("POST {path} {body}: {e}"));
        assert_eq!(response.header("Content-Type"), Some("text/event-stream"));
        let events = sse_events(response.into_reader());
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh agent (no connection shared between requests), generous timeouts.
pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .max_idle_connections(0)
        .build()
}

/// The status and JSON body of a response, errors included.
fn read(result: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let response = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("request failed: {e}"),
    };
    let status = response.status();
    let text = response.into_string().unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {text}"));
    (status, v)
}

/// `GET url`, with a bearer key when given.
pub fn get(url: &str, key: Option<&str>) -> (u16, Value) {
    let mut r = agent().get(url);
    if let Some(k) = key {
        r = r.set("Authorization", &format!("Bearer {k}"));
    }
    read(r.call())
}

/// `POST url` with `body` as it is (JSON or not), with a bearer key when given.
pub fn post_raw(url: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let mut r = agent().post(url).set("Content-Type", "application/json");
    if let Some(k) = key {
        r = r.set("Authorization", &format!("Bearer {k}"));
    }
    read(r.send_string(body))
}

/// The `data:` payloads of a server-sent event stream, to its end.
pub fn sse_events(reader: impl Read) -> Vec<String> {
    let mut events = Vec::new();
    for line in BufReader::new(reader).lines() {
        let line = line.unwrap();
        if let Some(d) = line.strip_prefix("data: ") {
            events.push(d.to_string());
        } else {
            assert!(
                line.is_empty() || line.starts_with(':'),
                "not an SSE line: {line}"
            );
        }
    }
    events
}

/// The token ids an answer reports in its `probespec` field.
pub fn token_ids(answer: &Value) -> Vec<u32> {
    answer["probespec"]["completion_token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no completion_token_ids: {answer}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

//! The interactive conversation: a turn with the cache of earlier turns reused gives the reply a one-shot
//! call on the rendered conversation gives, and the terminal front end (driven through a pseudo-terminal)
//! streams replies, prints a stats line per turn, reuses the cache, and ends on /exit and Ctrl-D.

mod common;

use common::decoding::{esp, greedy, hybrid, pld};
use common::TinySpec;
use probespec::conversation::Conversation;
use probespec::decode::generate::generate;
use probespec::decode::method::{EspTree, Method};
use probespec::model::load::{load_model, LoadOptions, ModelSource};
use probespec::tokenizer::Message;

/// Every turn of a three-turn conversation, for several methods and both architectures, equals a fresh
/// one-shot generation on the same rendered messages; from the second turn on, the earlier turns' prompt
/// comes from the cache.
#[test]
fn turns_reuse_the_cache_and_match_one_shot_generation() {
    for spec in [TinySpec::llama(), TinySpec::qwen3()] {
        let dir = common::tempdir();
        spec.write_hf(dir.path());
        let opts = LoadOptions {
            device: common::test_device(),
            dtype: candle_core::DType::F32,
            dequantize: false,
            activations: Default::default(),
        };
        let loaded = load_model(&ModelSource::HfDir(dir.path().to_path_buf()), &opts).unwrap();
        let (model, tok) = (&loaded.model, &loaded.tokenizer);
        let params = greedy(12, tok.stop_tokens().to_vec());
        for m in [
            Method::Ar,
            esp(10, 1, EspTree::Dynamic),
            pld(3, 10),
            hybrid(10, 1),
        ] {
            let mut chat = Conversation::new(model, tok, Some("w5 w6".into())).unwrap();
            let users = ["w10 w11 w12", "w20 w21", "w30 w31 w32 w33"];
            let mut previous_prompt = 0;
            for (i, user) in users.iter().enumerate() {
                let mut d = m.drafter(1).unwrap();
                let turn = chat.turn(user, d.as_mut(), &params, &mut |_| Ok(())).unwrap();

                let mut messages = vec![Message::new("system", "w5 w6")];
                messages.extend(chat.messages()[..chat.messages().len() - 1].iter().cloned());
                let prompt = tok
                    .encode(&tok.apply_chat_template(&messages, true).unwrap())
                    .unwrap();
                assert_eq!(turn.prompt_tokens, prompt.len());
                let mut d = m.drafter(1).unwrap();
                let fresh = generate(model, &prompt, d.as_mut(), &params, &mut |_| Ok(())).unwrap();
                assert_eq!(
                    turn.generation.tokens,
                    fresh.tokens,
                    "{:?} {m:?} turn {}: reply differs from a one-shot call",
                    spec.arch,
                    i + 1
                );
                if i > 0 {
                    // The earlier prompt is in the cache up to its generation prompt (the tiny template's
                    // last token), which the rendered conversation replaces with the assistant's turn.
                    assert!(
                        turn.reused_tokens >= previous_prompt - 1,
                        "turn {}: only {} of {} prompt tokens reused (previous prompt {previous_prompt})",
                        i + 1,
                        turn.reused_tokens,
                        prompt.len()
                    );
                    assert_eq!(
                        turn.generation.stats.prefill_tokens,
                        prompt.len() - turn.reused_tokens
                    );
                }
                previous_prompt = prompt.len();
            }
            chat.reset();
            let mut d = m.drafter(1).unwrap();
            let turn = chat.turn("w40", d.as_mut(), &params, &mut |_| Ok(())).unwrap();
            assert_eq!(turn.reused_tokens, 0, "after reset nothing comes from the cache");
            assert_eq!(chat.messages().len(), 2);
        }
    }
}

#[cfg(unix)]
mod terminal {
    use std::io::{Read, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::process::{Child, Command, Stdio};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    /// The binary on a pseudo-terminal: everything it prints is collected; `send` types.
    struct Session {
        child: Child,
        master: std::fs::File,
        screen: Arc<Mutex<String>>,
    }

    impl Session {
        fn start(args: &[&str]) -> Session {
            let (mut master_fd, mut slave_fd) = (0, 0);
            let mut size = libc::winsize {
                ws_row: 40,
                ws_col: 120,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let rc = unsafe {
                libc::openpty(
                    &mut master_fd,
                    &mut slave_fd,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    // `*mut` on macOS, `*const` on Linux: a `*mut` serves both.
                    std::ptr::addr_of_mut!(size),
                )
            };
            assert_eq!(rc, 0, "openpty failed");
            let slave = unsafe { OwnedFd::from_raw_fd(slave_fd) };
            let child = Command::new(env!("CARGO_BIN_EXE_probespec"))
                .args(args)
                .stdin(Stdio::from(slave.try_clone().unwrap()))
                .stdout(Stdio::from(slave.try_clone().unwrap()))
                .stderr(Stdio::from(slave))
                .env("TERM", "dumb")
                // The cost curve of --bc auto is timed and kept nowhere.
                .env("PROBESPEC_COST_DIR", crate::common::binary::NO_COST_CACHE)
                .spawn()
                .unwrap();
            let master = unsafe { std::fs::File::from_raw_fd(master_fd) };
            let screen = Arc::new(Mutex::new(String::new()));
            let (mut reader, sink) = (master.try_clone().unwrap(), screen.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                // Ends with an error (EIO) once the child has closed the terminal.
                while let Ok(n) = reader.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
            Session {
                child,
                master,
                screen,
            }
        }

        fn screen(&self) -> String {
            self.screen.lock().unwrap().clone()
        }

        /// Waits until `pred` holds for the screen (60 s at most).
        fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
            let t = Instant::now();
            loop {
                let s = self.screen();
                if pred(&s) {
                    return s;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "timed out waiting for {what}; screen:\n{s}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        fn send(&mut self, keys: &str) {
            self.master.write_all(keys.as_bytes()).unwrap();
            self.master.flush().unwrap();
        }

        fn exit_code(&mut self) -> i32 {
            let t = Instant::now();
            loop {
                if let Some(st) = self.child.try_wait().unwrap() {
                    return st.code().unwrap_or(-1);
                }
                if t.elapsed() > Duration::from_secs(30) {
                    let _ = self.child.kill();
                    panic!("the conversation did not end; screen:\n{}", self.screen());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// "(N from cache)" of every stats line so far.
    fn reused_counts(screen: &str) -> Vec<usize> {
        screen
            .split(" from cache)")
            .filter_map(|before| before.rsplit('(').next()?.trim().parse().ok())
            .collect()
    }

    fn prompts(screen: &str) -> usize {
        screen.matches(">>> ").count()
    }

    #[test]
    fn conversation_on_a_terminal() {
        let model = super::common::smollm2_path();
        let mut s = Session::start(&["--model", model.to_str().unwrap(), "--max-new-tokens", "12"]);
        s.wait_for("the first prompt", |x| prompts(x) >= 1);
        s.send("What is the capital of France?\r");
        let after1 = s.wait_for("the first stats line", |x| !reused_counts(x).is_empty());
        assert_eq!(
            reused_counts(&after1),
            vec![0],
            "the first turn has nothing cached"
        );
        let reply = after1
            .split("France?")
            .last()
            .and_then(|r| r.split("tok |").next())
            .unwrap_or("");
        assert!(
            reply.chars().filter(|c| c.is_alphabetic()).count() >= 5,
            "the reply is printed on the terminal:\n{after1}"
        );
        s.wait_for("the second prompt", |x| prompts(x) >= 2);
        s.send("And of Germany?\r");
        let after2 = s.wait_for("the second stats line", |x| reused_counts(x).len() >= 2);
        assert!(
            reused_counts(&after2)[1] > 20,
            "the second turn reuses the first turn's cache:\n{after2}"
        );
        s.wait_for("the third prompt", |x| prompts(x) >= 3);
        s.send("/reset\r");
        s.wait_for("the reset notice", |x| x.contains("(new conversation)"));
        s.wait_for("the fourth prompt", |x| prompts(x) >= 4);
        s.send("Hello\r");
        let after3 = s.wait_for("the third stats line", |x| reused_counts(x).len() >= 3);
        assert_eq!(
            reused_counts(&after3)[2],
            0,
            "after /reset nothing comes from the cache"
        );
        s.wait_for("the fifth prompt", |x| prompts(x) >= 5);
        s.send("/exit\r");
        assert_eq!(s.exit_code(), 0);
    }

    #[test]
    fn ctrl_d_ends_the_conversation() {
        let model = super::common::smollm2_path();
        let mut s = Session::start(&["--model", model.to_str().unwrap()]);
        s.wait_for("the prompt", |x| prompts(x) >= 1);
        s.send("\x04");
        assert_eq!(s.exit_code(), 0);
        assert!(!s.screen().contains("error"), "{}", s.screen());
    }
}

//! A chat answer's thinking apart from its reply (`--reasoning-format deepseek`): the text inside a
//! `<think>` ... `</think>` block at the start of the answer goes to `reasoning_content`, the rest to
//! `content`, as vLLM's and llama.cpp's reasoning parsers give it to OpenAI clients. Qwen 3 opens the block
//! itself; templates that end the prompt with `<think>` (DeepSeek-R1 style) leave the answer inside it.
//!
//! The splitter takes the answer's text in the pieces it is streamed in and holds back only what could
//! still turn out to be a tag, so that a streamed answer and a whole one split the same way. The tags and
//! the blank lines after `</think>` are left out; everything else of the text is kept, in order.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Which field a piece of the answer belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: a `<think>` may still open the answer.
    Start,
    /// Inside the thinking block.
    Thinking,
    /// After `</think>`, nothing but whitespace yet (left out).
    AfterThinking,
    /// The reply.
    Reply,
}

/// Splits an answer's text into thinking and reply as it streams.
#[derive(Debug)]
pub struct ThinkSplitter {
    state: State,
    /// Text held back: it may be part of a tag, or the whitespace before one.
    held: String,
}

impl ThinkSplitter {
    /// `open`: the prompt ended inside a thinking block, so the answer starts in one.
    pub fn new(open: bool) -> Self {
        let state = if open { State::Thinking } else { State::Start };
        ThinkSplitter {
            state,
            held: String::new(),
        }
    }

    /// The pieces `text` completes, in order.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            let held = std::mem::take(&mut self.held);
            match self.state {
                State::Start => {
                    let rest = held.trim_start();
                    if let Some(after) = rest.strip_prefix(OPEN) {
                        self.state = State::Thinking;
                        self.held = after.to_string();
                        continue;
                    }
                    if OPEN.starts_with(rest) {
                        self.held = held; // whitespace, or the start of `<think>`
                    } else {
                        self.state = State::Reply;
                        self.held = held;
                        continue;
                    }
                }
                State::Thinking => {
                    if let Some(at) = held.find(CLOSE) {
                        push(&mut out, Piece::Reasoning(held[..at].to_string()));
                        self.state = State::AfterThinking;
                        self.held = held[at + CLOSE.len()..].to_string();
                        continue;
                    }
                    let keep = partial_tag_len(&held, CLOSE);
                    push(&mut out, Piece::Reasoning(held[..held.len() - keep].to_string()));
                    self.held = held[held.len() - keep..].to_string();
                }
                State::AfterThinking => {
                    let rest = held.trim_start();
                    if !rest.is_empty() {
                        self.state = State::Reply;
                        self.held = rest.to_string();
                        continue;
                    }
                }
                State::Reply => push(&mut out, Piece::Content(held)),
            }
            return out;
        }
    }

    /// What is still held back, at the end of the answer: a tag never finished is text.
    pub fn finish(self) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.state {
            State::Start | State::Reply => push(&mut out, Piece::Content(self.held)),
            State::Thinking => push(&mut out, Piece::Reasoning(self.held)),
            State::AfterThinking => {}
        }
        out
    }

    /// The whole answer's thinking and reply (either empty when absent).
    pub fn split(text: &str, open: bool) -> (String, String) {
        let mut s = ThinkSplitter::new(open);
        let mut pieces = s.push(text);
        pieces.extend(s.finish());
        gather(pieces)
    }
}

/// Whether a rendered prompt leaves the answer inside a thinking block (the template opened it).
pub fn opens_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with(OPEN)
}

/// The thinking and the reply of `pieces`, each joined in order.
fn gather(pieces: impl IntoIterator<Item = Piece>) -> (String, String) {
    let (mut reasoning, mut content) = (String::new(), String::new());
    for p in pieces {
        match p {
            Piece::Reasoning(t) => reasoning.push_str(&t),
            Piece::Content(t) => content.push_str(&t),
        }
    }
    (reasoning, content)
}

/// Adds `p` unless its text is empty.
fn push(out: &mut Vec<Piece>, p: Piece) {
    let empty = match &p {
        Piece::Reasoning(t) | Piece::Content(t) => t.is_empty(),
    };
    if !empty {
        out.push(p);
    }
}

/// The length of the longest end of `text` that is a proper start of `tag` (text that may yet become it).
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of an answer streamed in `parts`, merged field by field.
    fn streamed(parts: &[&str], open: bool) -> (String, String) {
        let mut s = ThinkSplitter::new(open);
        let mut pieces: Vec<Piece> = parts.iter().flat_map(|p| s.push(p)).collect();
        pieces.extend(s.finish());
        gather(pieces)
    }

    #[test]
    fn whole_answers_split_as_the_reasoning_parsers_do() {
        let cases: [(&str, bool, &str, &str); 9] = [
            // Qwen 3 thinking, then replying.
            (
                "<think>\nThe user greets me.\n</think>\n\nHello!",
                false,
                "\nThe user greets me.\n",
                "Hello!",
            ),
            // Thinking turned off: the template wrote the empty block into the prompt.
            ("Hello!", false, "", "Hello!"),
            // A reply that mentions the tag later is all reply.
            ("Use <think> tags.", false, "", "Use <think> tags."),
            ("  <think>a</think>b", false, "a", "b"),
            // Cut by max_tokens while thinking.
            ("<think>\nstill going", false, "\nstill going", ""),
            // The prompt ended inside the block (DeepSeek-R1 style).
            ("reasoning</think>\n\nreply", true, "reasoning", "reply"),
            ("no close at all", true, "no close at all", ""),
            ("<think></think>", false, "", ""),
            // A tag started but never finished is text.
            ("<thi", false, "", "<thi"),
        ];
        for (text, open, reasoning, content) in cases {
            let got = ThinkSplitter::split(text, open);
            assert_eq!(got, (reasoning.to_string(), content.to_string()), "{text:?}");
        }
    }

    #[test]
    fn streamed_in_any_two_or_three_parts_splits_as_whole() {
        let texts = [
            "<think>\nr1 é\n</think>\n\nreply </think> <think>",
            "  <think>a</think>b",
            "<thin",
            "plain reply",
            "x</think>y",
        ];
        for text in texts {
            for open in [false, true] {
                let whole = ThinkSplitter::split(text, open);
                let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
                for &i in &bounds {
                    for &j in bounds.iter().filter(|&&j| j >= i) {
                        let parts = [&text[..i], &text[i..j], &text[j..]];
                        assert_eq!(streamed(&parts, open), whole, "{text:?} cut at {i}, {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn nothing_that_may_be_a_tag_is_sent_early_and_nothing_else_is_held() {
        let mut s = ThinkSplitter::new(false);
        assert_eq!(s.push("<th"), vec![]);
        assert_eq!(s.push("ink>abc</th"), vec![Piece::Reasoning("abc".into())]);
        assert_eq!(s.push("ink>\n"), vec![]);
        assert_eq!(s.push("\nok"), vec![Piece::Content("ok".into())]);
        assert_eq!(s.push(" more"), vec![Piece::Content(" more".into())]);
        assert_eq!(s.finish(), vec![]);
    }
}

//! Streaming detokenisation: turns generated ids into text as they arrive.
//!
//! Decoding one token at a time is wrong twice over: a byte-level token may hold only part of a
//! multi-byte UTF-8 character (an emoji is often two or three tokens), and some decoders treat the
//! first token of a sequence specially (SentencePiece's leading-space rule). So, as HF's
//! `TextStreamer` and candle's `TokenOutputStream` do, we re-decode a short window of recent ids
//! and emit only the text the newest id added, holding it back while it ends in an incomplete
//! character (U+FFFD). The pieces concatenate to `decode(all ids)`.

use anyhow::Result;

use super::TextTokenizer;

/// Incremental detokeniser over a [`TextTokenizer`].
pub struct StreamDecoder<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    /// Start of the window re-decoded for context: the ids already emitted before `read_offset`
    /// that the decoder needs to see to get the next piece right.
    prefix_offset: usize,
    /// Ids before this one have been emitted as text.
    read_offset: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a TextTokenizer) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one id; returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix_text = self.decode_range(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode_range(self.prefix_offset, self.ids.len())?;
        // A trailing U+FFFD is (almost always) a character whose remaining bytes are still to
        // come: wait for them. A real U+FFFD at the very end comes out in `finish`.
        if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            let piece = suffix_after(&new_text, &prefix_text);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Flushes whatever is still held back (e.g. an incomplete character at the end of output).
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.read_offset >= self.ids.len() {
            return Ok(None);
        }
        let prefix_text = self.decode_range(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode_range(self.prefix_offset, self.ids.len())?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if new_text.len() > prefix_text.len() {
            Ok(Some(suffix_after(&new_text, &prefix_text)))
        } else {
            Ok(None)
        }
    }

    fn decode_range(&self, start: usize, end: usize) -> Result<String> {
        if start >= end {
            return Ok(String::new());
        }
        self.tok.decode(&self.ids[start..end])
    }
}

/// The part of `full` after `prefix`. The window's text normally starts with the prefix's text;
/// if a decoder ever rewrote it, fall back to the byte position (on a char boundary) so the
/// stream never stalls.
fn suffix_after(full: &str, prefix: &str) -> String {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest.to_string();
    }
    let mut cut = prefix.len().min(full.len());
    while !full.is_char_boundary(cut) {
        cut += 1;
    }
    full[cut..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_after_handles_rewrites() {
        assert_eq!(suffix_after("hello world", "hello"), " world");
        assert_eq!(suffix_after("héllo", "hx"), "llo");
        assert_eq!(suffix_after("ab", ""), "ab");
    }
}

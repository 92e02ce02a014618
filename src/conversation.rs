//! A multi-turn conversation over one model: the messages so far and the KV cache of their tokens.
//!
//! Each turn renders the whole conversation through the chat template (as a fresh request would), so the
//! model sees exactly what a one-shot call with the same messages sees. Only the tokens after the longest
//! prefix that is already in the cache are prefilled: normally the new user message, or a little more where
//! re-encoding the previous answer's text gives other tokens than were generated. With the row-invariant
//! CPU kernels a reused cache computes the same numbers as a fresh prefill, so a turn's reply is the
//! reply a one-shot call on the rendered conversation gives.
//!
//! The cache part, [`PrefixCache`], is shared with the server, whose clients send the whole conversation
//! with every request.

use crate::decode::generate::{generate_in, Drafter, GenerateParams, Generation};
use crate::decode::prefill::common_prefix;
use crate::model::{KvCache, Transformer};
use crate::tokenizer::{Message, TextTokenizer};
use anyhow::{bail, Result};

pub struct Conversation<'a> {
    model: &'a Transformer,
    tokenizer: &'a TextTokenizer,
    system: Option<String>,
    messages: Vec<Message>,
    cache: PrefixCache,
}

/// A KV cache and the tokens it holds: each generation prefills only what its prompt does not share with
/// the previous prompt and answer.
pub struct PrefixCache {
    cache: KvCache,
    /// The tokens whose keys and values `cache` holds, in order.
    cached: Vec<u32>,
}

impl PrefixCache {
    pub fn new(model: &Transformer) -> Result<Self> {
        Ok(PrefixCache {
            cache: model.new_cache(0)?,
            cached: Vec::new(),
        })
    }

    /// Forgets what the cache holds.
    pub fn clear(&mut self) {
        self.cached.clear();
        self.cache.truncate(0);
    }

    /// Generates from `prompt`, reusing the longest prefix of it already in the cache (the prompt tokens
    /// it did not prefill, `stats.prefill_tokens`, came from there). After a failure the cache keeps only
    /// what is known to be valid.
    pub fn generate(
        &mut self,
        model: &Transformer,
        prompt: &[u32],
        drafter: &mut dyn Drafter,
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        if prompt.is_empty() {
            bail!("the prompt is empty");
        }
        let reused = common_prefix(&self.cached, prompt).min(prompt.len() - 1);
        self.cache.truncate(reused);
        self.cached.truncate(reused);
        let generation = match generate_in(model, &mut self.cache, prompt, drafter, params, on_token) {
            Ok(g) => g,
            Err(e) => {
                // The cache may hold rows of the failed generation: keep only what is known to be valid.
                self.cache.truncate(reused);
                return Err(e);
            }
        };
        let mut history = prompt.to_vec();
        history.extend_from_slice(&generation.tokens);
        history.truncate(self.cache.len());
        self.cached = history;
        Ok(generation)
    }
}

/// One finished turn.
pub struct Turn {
    pub generation: Generation,
    /// The reply's text (special tokens removed, trimmed), as the next turn's template sees it.
    pub text: String,
    /// Tokens of the rendered conversation, and how many of them came from the cache.
    pub prompt_tokens: usize,
    pub reused_tokens: usize,
}

impl<'a> Conversation<'a> {
    pub fn new(model: &'a Transformer, tokenizer: &'a TextTokenizer, system: Option<String>) -> Result<Self> {
        if !tokenizer.has_chat_template() {
            bail!("the model has no chat template: a conversation needs one");
        }
        Ok(Conversation {
            model,
            tokenizer,
            system,
            messages: Vec::new(),
            cache: PrefixCache::new(model)?,
        })
    }

    /// Forgets the messages and the cache: the next turn starts a new conversation.
    pub fn reset(&mut self) {
        self.messages.clear();
        self.cache.clear();
    }

    /// Messages so far (the system message, if any, is not among them).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The token ids of the conversation with `user` appended, ready for the assistant's reply.
    fn render(&self, user: &str) -> Result<Vec<u32>> {
        let mut messages: Vec<Message> = self
            .system
            .iter()
            .map(|s| Message::new("system", s.clone()))
            .collect();
        messages.extend(self.messages.iter().cloned());
        messages.push(Message::new("user", user));
        let ids = self
            .tokenizer
            .encode(&self.tokenizer.apply_chat_template(&messages, true)?)?;
        Ok(ids)
    }

    /// Asks `user` and streams the reply's tokens to `on_token`. The drafter is the method of this turn.
    /// A failed turn leaves the conversation as it was before it.
    pub fn turn(
        &mut self,
        user: &str,
        drafter: &mut dyn Drafter,
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Turn> {
        crate::session::check_prompt_text(user)?;
        let prompt = self.render(user)?;
        let generation = self
            .cache
            .generate(self.model, &prompt, drafter, params, on_token)?;
        let reused_tokens = prompt.len() - generation.stats.prefill_tokens;
        let text = self.tokenizer.decode(&generation.tokens)?.trim().to_string();
        self.messages.push(Message::new("user", user));
        self.messages.push(Message::new("assistant", text.clone()));
        Ok(Turn {
            generation,
            text,
            prompt_tokens: prompt.len(),
            reused_tokens,
        })
    }
}

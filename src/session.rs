//! A loaded model ready to answer: device and dtype selection, model and tokenizer loading, and the prompt
//! through the chat template. What the CLI, the benchmark, the tests and the benches start from.

use crate::decode::cost_cache::{self, CurveKey, CurveStore};
use crate::decode::generate::{generate, GenerateParams, Generation};
use crate::decode::method::Method;
use crate::model::load::{load_model, Activations, LoadOptions, ModelSource};
use crate::model::Transformer;
use crate::tokenizer::{compile_chat_template, Message, TemplateVars, TextTokenizer};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
    Metal,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Metal => "metal",
        }
    }

    /// The device, or an error saying why this binary or machine has none.
    pub fn device(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => {
                if !candle_core::utils::cuda_is_available() {
                    bail!("CUDA is not available: this binary was built without the `cuda` feature or no GPU was found");
                }
                Ok(Device::new_cuda(0)?)
            }
            DeviceKind::Metal => {
                if !candle_core::utils::metal_is_available() {
                    bail!("Metal is not available: this binary was built without the `metal` feature");
                }
                Ok(Device::new_metal(0)?)
            }
        }
    }
}

/// Which model, where, in which dtype.
#[derive(Debug, Clone, Default)]
pub struct ModelOptions {
    /// HF folder, `.gguf` file or hub id; `None`: the default SmolLM2 GGUF.
    pub model: Option<String>,
    pub device: DeviceKind,
    /// `None`: f32 on the CPU, bf16 on a GPU.
    pub dtype: Option<DType>,
    /// Run GGUF block-quantised weights dense instead of in their blocks.
    pub dequantize: bool,
    /// Activations for GGUF quantised weights on the CPU: 8-bit (default) or f32.
    pub activations: Activations,
    /// What the CPU kernels' KV cache holds (f32 or bf16); `None`: [`crate::model::DEFAULT_KV_DTYPE`].
    pub kv_dtype: Option<DType>,
    /// Variables every chat-template rendering passes (`--chat-template-kwargs`).
    pub chat_template_vars: TemplateVars,
    /// A Jinja chat template to use instead of the model's (`--chat-template-file`).
    pub chat_template_file: Option<PathBuf>,
}

impl ModelOptions {
    /// How GGUF quantised weights are multiplied on the CPU: "q8", "f32" or "dequantized".
    pub fn activations_name(&self) -> &'static str {
        match (self.dequantize, self.activations) {
            (true, _) => "dequantized",
            (false, Activations::Q8) => "q8",
            (false, Activations::F32) => "f32",
        }
    }

    /// The dtype asked for, or the device's default: f32 on the CPU, bf16 on a GPU.
    pub fn dtype_on(&self, device: &Device) -> DType {
        match self.dtype {
            Some(d) => d,
            None if device.is_cpu() => DType::F32,
            None => DType::BF16,
        }
    }
}

/// A model and its tokenizer, loaded once, shared by every generation.
///
/// # Example
///
/// Needs a checkpoint (the default, `ModelOptions::default()`, is SmolLM2-135M-Instruct's GGUF), so it is
/// compiled but not run here:
///
/// ```no_run
/// use probespec::decode::generate::GenerateParams;
/// use probespec::decode::method::Method;
/// use probespec::session::{ModelOptions, Session};
/// use probespec::tokenizer::StreamDecoder;
///
/// # fn main() -> anyhow::Result<()> {
/// let session = Session::load(&ModelOptions {
///     model: Some("SmolLM2-135M-Instruct.Q4_1.gguf".into()),
///     ..ModelOptions::default()
/// })?;
/// let prompt = session.encode_prompt("Name three primes.", None, true)?;
/// let params = GenerateParams {
///     max_new_tokens: 64,
///     sampling: Default::default(), // greedy
///     stop_tokens: session.stop_tokens(),
///     max_block_rows: None,
/// };
/// let mut text = StreamDecoder::new(&session.tokenizer);
/// let g = session.generate(&prompt, &Method::default(), &params, &mut |t| {
///     if let Some(piece) = text.push(t)? {
///         print!("{piece}");
///     }
///     Ok(())
/// })?;
/// println!("\n{}", g.stats.summary_line(prompt.len()));
/// # Ok(())
/// # }
/// ```
pub struct Session {
    pub model: Transformer,
    pub tokenizer: TextTokenizer,
    /// What was loaded, for humans and run records.
    pub description: String,
    /// Where the model's forward cost curve (`--bc auto`) is kept on disk; attached to the model, so its
    /// first auto step reads it (or measures and writes it).
    pub cost_store: CurveStore,
}

impl Session {
    pub fn load(opts: &ModelOptions) -> Result<Session> {
        // Read and compiled before the model loads, so that a wrong file fails at once.
        let chat_template = match &opts.chat_template_file {
            Some(path) => {
                let source = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the chat template {}", path.display()))?;
                Some(compile_chat_template(source).with_context(|| path.display().to_string())?)
            }
            None => None,
        };
        let device = opts.device.device()?;
        let dtype = opts.dtype_on(&device);
        let isa_ceiling = crate::kernels::isa::ceiling_from_env().map_err(anyhow::Error::msg)?;
        let source = ModelSource::resolve(opts.model.as_deref())?;
        let loaded = load_model(
            &source,
            &LoadOptions {
                device,
                dtype,
                dequantize: opts.dequantize,
                activations: opts.activations,
            },
        )?;
        let model = match opts.kv_dtype {
            Some(kv) => loaded.model.with_kv_dtype(kv)?,
            None => loaded.model,
        };
        let model_id = match &source {
            ModelSource::HfDir(p) | ModelSource::Gguf(p) => p.display().to_string(),
            ModelSource::Hub(id) => id.clone(),
        };
        let mut activations = opts.activations_name().to_string();
        // Ops other than the device's default (`PROBESPEC_OPS`) cost differently: a curve of their own.
        let ops = model.ops();
        if ops != crate::model::Ops::default_for(&model.device, dtype) {
            activations = format!("{activations}-{}", ops.name());
        }
        // Kernels capped at a lesser variant (`PROBESPEC_ISA`) run slower: a curve of their own.
        if let Some(isa) = isa_ceiling {
            activations = format!("{activations}-{}", isa.name());
        }
        // A bf16 KV cache reads half the bytes per cached token (curves measured before it, f32 ones).
        if ops == crate::model::Ops::Kernels && model.kv_dtype() == DType::BF16 {
            activations = format!("{activations}-kv-bf16");
        }
        let cost_store = CurveStore::new(CurveKey::new(
            &model_id,
            opts.device.name(),
            dtype.as_str(),
            &activations,
        ));
        cost_cache::attach(&model, cost_store.clone());
        let mut tokenizer = loaded.tokenizer;
        if let Some(template) = chat_template {
            tokenizer.set_chat_template(template);
        }
        tokenizer.set_chat_template_vars(opts.chat_template_vars.clone())?;
        Ok(Session {
            model,
            tokenizer,
            description: loaded.description,
            cost_store,
        })
    }

    /// Prompt text -> token ids, through the chat template (with an optional system message) unless
    /// `chat` is false.
    pub fn encode_prompt(&self, text: &str, system: Option<&str>, chat: bool) -> Result<Vec<u32>> {
        encode_prompt(&self.tokenizer, text, system, chat)
    }

    /// The prompt text as the model reads it: through the chat template unless `chat` is false.
    pub fn render_prompt(&self, text: &str, system: Option<&str>, chat: bool) -> Result<String> {
        render_prompt(&self.tokenizer, text, system, chat)
    }

    /// The stop tokens of the model's tokenizer.
    pub fn stop_tokens(&self) -> Vec<u32> {
        self.tokenizer.stop_tokens().to_vec()
    }

    /// One generation from prompt ids with `method`; `on_token` sees every committed token.
    pub fn generate(
        &self,
        prompt: &[u32],
        method: &Method,
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        let mut drafter = method.drafter(params.sampling.seed)?;
        generate(&self.model, prompt, drafter.as_mut(), params, on_token)
    }
}

/// What `path` names in messages: the file, or stdin for "-".
pub fn source_name(path: &str) -> &str {
    if path == "-" {
        "stdin"
    } else {
        path
    }
}

/// The text of file `path`, or of stdin when `path` is "-"; an error naming it when it cannot be read or
/// is not UTF-8.
pub fn read_text(path: &str) -> Result<String> {
    let name = source_name(path);
    let bytes = if path == "-" {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).map(|_| bytes)
    } else {
        std::fs::read(path)
    };
    let bytes = bytes.with_context(|| format!("cannot read {name}"))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{name} is not valid UTF-8 (byte {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// A prompt must hold more than white space (checked before anything slow, such as loading a model).
pub fn check_prompt_text(text: &str) -> Result<()> {
    if text.trim().is_empty() {
        bail!("the prompt is empty");
    }
    Ok(())
}

/// Prompt text -> the text the model reads, through the chat template unless `chat` is false.
pub fn render_prompt(tok: &TextTokenizer, text: &str, system: Option<&str>, chat: bool) -> Result<String> {
    check_prompt_text(text)?;
    if !chat {
        return Ok(text.to_string());
    }
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(Message::new("system", s));
    }
    messages.push(Message::new("user", text));
    tok.apply_chat_template(&messages, true)
}

/// Prompt text -> token ids, through the chat template unless `chat` is false.
pub fn encode_prompt(tok: &TextTokenizer, text: &str, system: Option<&str>, chat: bool) -> Result<Vec<u32>> {
    let ids = tok.encode(&render_prompt(tok, text, system, chat)?)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    Ok(ids)
}

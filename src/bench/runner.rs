//! Running a benchmark: configurations, warm-up, the per-question loop, records and progress.
//!
//! Every question is decoded by every configuration in turn (ar first) before the next question, in one
//! process, so a drift of the machine (clock, thermal state, other load) over a long run hits every
//! method alike instead of favouring whichever ran in the cooler hour.

use super::questions::{questions_or_bundled, select, Question, Selection};
use super::records::{
    complete_conversations, keep_complete, median_run, read_records, setting_differences, write_records,
    Invocation, Record, RecordLog, RunInfo, Settings, RECORDS_FILE,
};
use crate::decode::generate::GenerateParams;
use crate::decode::method::{
    Budget, EspSpec, EspTree, HybridSpec, LookaheadConfig, MaskInit, Masks, Method, MethodKind, PldConfig,
};
use crate::decode::sampling::SamplingParams;
use crate::facts::{self, fnv1a_hex};
use crate::session::{DeviceKind, ModelOptions, Session};
use crate::tokenizer::Message;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

/// One way of decoding: a method and its parameters, under a name.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Column/row name, e.g. "ar", "esp-bc30-k1".
    pub name: String,
    pub method: Method,
}

/// What `probespec bench` runs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Question file; `None`: the bundled Spec-Bench questions.
    pub questions: Option<PathBuf>,
    pub model: ModelOptions,
    /// Methods to compare; ar is the reference of speedups and of the lossless check.
    pub methods: Vec<MethodKind>,
    /// Block complexities for esp and hybrid (one configuration each, times `masks`).
    pub bc: Vec<Budget>,
    /// Mask counts (k) for esp and hybrid.
    pub masks: Vec<usize>,
    /// ESP's static tree instead of the dynamic one.
    pub static_tree: bool,
    pub mask_init: MaskInit,
    pub mask_lambda: f32,
    pub max_new_tokens: usize,
    /// Keep only these categories or groups.
    pub categories: Vec<String>,
    /// Pass over the first N questions of each category.
    pub skip_per_category: usize,
    /// Keep the first N questions of each category (after those skipped).
    pub limit_per_category: Option<usize>,
    /// Output folder; a folder with records is resumed.
    pub out: PathBuf,
    /// Run the questions at index % N == I of the selection.
    pub shard: Option<(usize, usize)>,
    /// Unrecorded runs of the first question by every configuration before measuring.
    pub warmup: usize,
    /// Runs of each question by every configuration, interleaved; each turn keeps the median.
    pub repeats: usize,
    pub system: Option<String>,
    /// Seed of drafters that draw random numbers.
    pub seed: u64,
}

/// The configurations of a run: methods × (for methods with a block complexity: bc × masks), ar first,
/// duplicates removed; every method's other parameters at `probespec`'s defaults.
pub fn configurations(a: &BenchOptions) -> Result<Vec<BenchConfig>> {
    let masks = |k| Masks {
        count: k,
        init: a.mask_init,
        lambda: a.mask_lambda,
    };
    let tree = if a.static_tree {
        EspTree::Static(None)
    } else {
        EspTree::Dynamic
    };
    let mut out: Vec<BenchConfig> = Vec::new();
    for &m in &a.methods {
        let single = |method| BenchConfig {
            name: m.to_string(),
            method,
        };
        match m {
            MethodKind::Ar => out.push(single(Method::Ar)),
            MethodKind::Pld => out.push(single(Method::Pld(PldConfig::default()))),
            MethodKind::Lookahead => out.push(single(Method::Lookahead(LookaheadConfig::default()))),
            MethodKind::Esp | MethodKind::Hybrid => {
                for &bc in &a.bc {
                    for &k in &a.masks {
                        let method = if m == MethodKind::Esp {
                            Method::Esp(EspSpec {
                                masks: masks(k),
                                budget: bc,
                                tree: tree.clone(),
                            })
                        } else {
                            Method::Hybrid(HybridSpec {
                                masks: masks(k),
                                budget: bc,
                                lookup: PldConfig::default(),
                            })
                        };
                        let bc = match bc {
                            Budget::Auto => "auto".to_string(),
                            Budget::Fixed(n) => n.to_string(),
                        };
                        out.push(BenchConfig {
                            name: format!("{m}-bc{bc}-k{k}"),
                            method,
                        });
                    }
                }
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|c| seen.insert(c.name.clone()));
    // ar runs first on every question: it is the reference the others are checked against.
    out.sort_by_key(|c| c.method.kind() != MethodKind::Ar);
    if out.is_empty() {
        bail!("--methods selects no configuration");
    }
    // Bad parameters (a bc too small for its masks, ...) fail now, not after the model has loaded.
    for c in &out {
        c.method
            .validate()
            .with_context(|| format!("configuration {}", c.name))?;
    }
    Ok(out)
}

/// The model and decoding parameters shared by every conversation (`params.sampling.seed` also seeds the
/// drafters).
struct Engine<'a> {
    session: &'a Session,
    params: GenerateParams,
    system: Option<String>,
}

impl Engine<'_> {
    /// Asks one question's turns in one conversation, each turn after this configuration's own answer to
    /// the previous ones, re-encoded from scratch as Spec-Bench does. `on_turn` gets each turn's record.
    fn conversation(
        &self,
        q: &Question,
        c: &BenchConfig,
        on_turn: &mut dyn FnMut(Record) -> Result<()>,
    ) -> Result<()> {
        let tok = &self.session.tokenizer;
        let mut messages: Vec<Message> = self
            .system
            .iter()
            .map(|s| Message::new("system", s.clone()))
            .collect();
        for (t, text) in q.turns.iter().enumerate() {
            messages.push(Message::new("user", text.clone()));
            let prompt = tok.encode(&tok.apply_chat_template(&messages, true)?)?;
            let t0 = Instant::now();
            let g = self
                .session
                .generate(&prompt, &c.method, &self.params, &mut |_| Ok(()))
                .with_context(|| format!("question {} turn {} ({})", q.question_id, t + 1, c.name))?;
            let wall_seconds = t0.elapsed().as_secs_f64();
            // The answer as the next turn sees it: text without special tokens, trimmed (Spec-Bench
            // strips stop strings and whitespace the same way).
            let answer = tok.decode(&g.tokens)?.trim().to_string();
            let text_tokens = tok.encode(&answer)?.len();
            messages.push(Message::new("assistant", answer.clone()));
            let committed = g.stats.committed_by_calls();
            on_turn(Record {
                question_id: q.question_id,
                category: q.category.clone(),
                group: q.group(),
                turn: t + 1,
                turns: q.turns.len(),
                config: c.name.clone(),
                method: c.method.kind(),
                bc: c.method.budget(),
                masks: c.method.masks(),
                prompt_tokens: prompt.len(),
                new_tokens: g.tokens.len(),
                model_calls: g.stats.model_calls,
                committed,
                tau: if g.stats.model_calls > 0 {
                    committed as f64 / g.stats.model_calls as f64
                } else {
                    1.0
                },
                decode_seconds: g.stats.decode_seconds,
                prefill_seconds: g.stats.prefill_seconds,
                wall_seconds,
                tokens: g.tokens,
                finish_reason: g.finish_reason,
                accept_lengths: g.stats.accept_lengths,
                block_histogram: g.stats.block_histogram,
                text: Some(answer),
                text_tokens: Some(text_tokens),
            })?;
        }
        Ok(())
    }
}

/// Running tau per configuration for the progress line: (committed, model calls).
#[derive(Default)]
struct RunningTau(Vec<(String, usize, usize)>);

impl RunningTau {
    fn new(configs: &[BenchConfig]) -> Self {
        RunningTau(configs.iter().map(|c| (c.name.clone(), 0, 0)).collect())
    }
    fn add(&mut self, r: &Record) {
        if let Some(e) = self.0.iter_mut().find(|e| e.0 == r.config) {
            e.1 += r.committed;
            e.2 += r.model_calls;
        }
    }
    fn line(&self) -> String {
        let cells: Vec<String> = self
            .0
            .iter()
            .map(|(n, c, m)| {
                if *m > 0 {
                    format!("{n} {:.2}", *c as f64 / *m as f64)
                } else {
                    format!("{n} -")
                }
            })
            .collect();
        format!("tau {}", cells.join(" | "))
    }
}

fn device_name(a: &BenchOptions) -> String {
    let arg = a.model.device.name().to_string();
    match a.model.device {
        DeviceKind::Cuda => facts::gpu_name().map(|g| format!("cuda:0 ({g})")).unwrap_or(arg),
        _ => arg,
    }
}

/// `probespec bench [--questions ...]`.
pub fn run_bench(a: &BenchOptions) -> Result<()> {
    let (all, questions_hash, questions_file) = questions_or_bundled(a.questions.as_deref())?;
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let sel = Selection {
        categories: a.categories.clone(),
        skip_per_category: a.skip_per_category,
        limit_per_category: a.limit_per_category,
        shard: a.shard,
    };
    let questions = select(&all, &sel)?;
    if questions.is_empty() {
        bail!("the selection holds no questions (--categories, --skip-per-category, --limit-per-category and --shard leave none)");
    }
    let configs = configurations(a)?;
    if !configs.iter().any(|c| c.method.kind() == MethodKind::Ar) {
        eprintln!("warning: no ar configuration: speedups and the lossless check will be missing");
    }

    std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    let rec_path = a.out.join(RECORDS_FILE);
    let file = read_records(&rec_path)?;
    let previous = RunInfo::read(&a.out)?;
    if previous.is_none() && !file.records.is_empty() {
        bail!(
            "{} holds records but no run.json; pass another --out",
            a.out.display()
        );
    }
    let mut settings = Settings {
        model: a.model.model.clone().unwrap_or_else(|| "default".into()),
        model_description: String::new(),
        device: a.model.device.name().to_string(),
        dtype: String::new(),
        activations: a.model.activations_name().to_string(),
        kv_cache: String::new(),
        max_new_tokens: a.max_new_tokens,
        tree: if a.static_tree { "static" } else { "dynamic" }.to_string(),
        mask_init: a.mask_init.name().to_string(),
        mask_lambda: a
            .mask_lambda
            .to_string()
            .parse()
            .unwrap_or(f64::from(a.mask_lambda)),
        seed: a.seed,
        system: a.system.clone(),
        chat_template_kwargs: a.model.chat_template_vars.clone(),
        chat_template_file: match &a.model.chat_template_file {
            Some(path) => {
                let bytes = std::fs::read(path)
                    .with_context(|| format!("reading the chat template {}", path.display()))?;
                Some(format!("{} ({})", path.display(), fnv1a_hex(&bytes)))
            }
            None => None,
        },
        questions_file,
        questions_hash,
        categories: a.categories.clone(),
        skip_per_category: a.skip_per_category,
        limit_per_category: a.limit_per_category,
        shard: a.shard.map(|(i, n)| format!("{i}/{n}")),
    };
    // Records of another setup must not be mixed in; most of the check runs before the (slow) model load.
    let check = |s: &Settings, ignore: &[&str]| -> Result<()> {
        if let Some(prev) = &previous {
            let diffs = setting_differences(&prev.settings, s, ignore);
            if !diffs.is_empty() {
                bail!(
                    "{} holds a run with other settings ({}): pass another --out to start a new run",
                    a.out.display(),
                    diffs.join("; ")
                );
            }
        }
        Ok(())
    };
    check(
        &settings,
        &["questions_file", "model_description", "dtype", "kv_cache"],
    )?;

    let loaded = Session::load(&a.model)?;
    if !loaded.tokenizer.has_chat_template() {
        bail!(
            "{} has no chat template: Spec-Bench asks questions as a chat",
            loaded.description
        );
    }
    settings.model_description = loaded.description.clone();
    settings.dtype = loaded.model.dtype.as_str().to_string();
    settings.kv_cache = loaded.model.kv_dtype().as_str().to_string();
    check(&settings, &["questions_file"])?;

    // Resume: keep finished conversations, drop a half-written line and half-done conversations.
    let (records, dropped) = keep_complete(file.records);
    for n in &file.notes {
        eprintln!("{}: {n}", rec_path.display());
    }
    if dropped > 0 {
        eprintln!(
            "{}: {dropped} record(s) of unfinished conversations dropped, to be redone",
            rec_path.display()
        );
    }
    if file.dirty || dropped > 0 {
        write_records(&rec_path, &records)?;
    }
    let done = complete_conversations(&records);
    // (question index, configurations still to run on it).
    let todo: Vec<(usize, Vec<usize>)> = questions
        .iter()
        .enumerate()
        .map(|(qi, q)| {
            let cs: Vec<usize> = (0..configs.len())
                .filter(|&ci| !done.contains(&(q.question_id, configs[ci].name.clone())))
                .collect();
            (qi, cs)
        })
        .filter(|(_, cs)| !cs.is_empty())
        .collect();
    let total_turns: usize = todo
        .iter()
        .map(|(qi, cs)| questions[*qi].turns.len() * cs.len())
        .sum();

    let mut run = previous.unwrap_or(RunInfo {
        settings: settings.clone(),
        invocations: Vec::new(),
    });
    run.settings = settings;
    let invocation = Invocation {
        date: facts::utc_now(),
        command: facts::command_line(),
        probespec_version: env!("CARGO_PKG_VERSION").to_string(),
        git_commit: facts::git_commit(),
        cpu: facts::cpu_model(),
        threads: facts::threads(),
        device: device_name(a),
        configs: configs.iter().map(|c| c.name.clone()).collect(),
        warmup: a.warmup,
        repeats: a.repeats,
        shard: run.settings.shard.clone(),
    };
    // Records of another build are not resumed: the run would mix two builds' speeds (and choices).
    if let Some(prev) = run
        .invocations
        .iter()
        .find(|i| i.git_commit != invocation.git_commit)
    {
        if total_turns > 0 && !records.is_empty() {
            bail!(
                "{} holds records made by commit {}, and this binary is {}: measure this build in a new --out",
                a.out.display(),
                prev.git_commit,
                invocation.git_commit
            );
        }
    }
    if let Some(prev) = run.invocations.last() {
        if total_turns > 0 && (prev.cpu != invocation.cpu || prev.device != invocation.device) {
            eprintln!(
                "warning: resuming on another machine ({} / {} before, {} / {} now): speedups will mix machines",
                prev.cpu, prev.device, invocation.cpu, invocation.device
            );
        }
    }
    if total_turns > 0 {
        run.invocations.push(invocation);
    }
    run.write(&a.out)?;

    let engine = Engine {
        session: &loaded,
        params: GenerateParams {
            max_new_tokens: a.max_new_tokens,
            sampling: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                seed: a.seed,
            },
            stop_tokens: loaded.tokenizer.stop_tokens().to_vec(),
            max_block_rows: None,
        },
        system: a.system.clone(),
    };

    let tty = std::io::stderr().is_terminal();
    let repeats = a.repeats.max(1);
    let bar =
        ProgressBar::with_draw_target(Some((total_turns * repeats) as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} turns, ETA {eta} | {msg}")
            .expect("valid progress template")
            .progress_chars("=> "),
    );
    let mut tau = RunningTau::new(&configs);
    records.iter().for_each(|r| tau.add(r));
    if !done.is_empty() && total_turns > 0 {
        eprintln!(
            "resuming {}: {} finished question × configuration pairs kept, {} turns to go",
            a.out.display(),
            done.len(),
            total_turns
        );
    }

    // Warm-up: Spec-Bench runs the first question 3 times before measuring; here every configuration
    // does, so each one's kernels and buffers are warm.
    if let Some((qi, _)) = todo.first() {
        for w in 0..a.warmup {
            bar.set_message(format!("warm-up {}/{}", w + 1, a.warmup));
            if !tty {
                eprintln!(
                    "warm-up {}/{} on question {}",
                    w + 1,
                    a.warmup,
                    questions[*qi].question_id
                );
            }
            for c in &configs {
                engine.conversation(&questions[*qi], c, &mut |_| Ok(()))?;
            }
        }
    }

    let mut log = RecordLog::open_append(&rec_path)?;
    bar.set_message(tau.line());
    let started = Instant::now();
    for (k, (qi, cs)) in todo.iter().enumerate() {
        let q = &questions[*qi];
        // Repeats go round the configurations, so each one's runs see the same spread of load.
        let mut runs: Vec<Vec<Vec<Record>>> = vec![Vec::with_capacity(repeats); cs.len()];
        for _ in 0..repeats {
            for (j, &ci) in cs.iter().enumerate() {
                let mut turns = Vec::new();
                engine.conversation(q, &configs[ci], &mut |r| {
                    turns.push(r);
                    bar.inc(1);
                    Ok(())
                })?;
                runs[j].push(turns);
            }
        }
        for config_runs in runs {
            for r in median_run(config_runs)? {
                log.append(&r)?;
                tau.add(&r);
            }
        }
        bar.set_message(tau.line());
        if !tty {
            // Without a terminal the bar is hidden: a line per question keeps logs informative.
            let frac = (k + 1) as f64 / todo.len() as f64;
            let elapsed = started.elapsed().as_secs_f64();
            eprintln!(
                "question {} ({}) done, {}/{} | {:.0}s, ETA {:.0}s | {}",
                q.question_id,
                q.category,
                k + 1,
                todo.len(),
                elapsed,
                elapsed / frac - elapsed,
                tau.line()
            );
        }
    }
    bar.finish_and_clear();
    drop(log);

    let all_records = read_records(&rec_path)?.records;
    let table = super::render_outputs(&a.out, &run, all_records)?;
    super::write_stdout(&table)?;
    Ok(())
}

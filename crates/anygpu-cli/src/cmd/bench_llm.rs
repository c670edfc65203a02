//! `anygpu bench llm -m FILE [-p 512] [-n 128] [-d 0] [-r 3]`: prefill and decode speed like
//! llama-bench (pp: a prompt of random tokens; tg: tokens generated one at a time; `-d`: both
//! after that many tokens already in the context, untimed).

use std::time::Instant;

use anygpu_core::bench::warm_up;
use anygpu_models::llama::{KvCache, Llama};
use serde::Serialize;

use super::llm::{describe, load, ModelArgs};
use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens for the prefill test (0 = skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens for the decode test (0 = skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Tokens already in the context when each test starts (prefilled, not timed), as
    /// llama-bench's `-d`: the speed at that depth of a conversation.
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    n_depth: usize,
    /// Repetitions (the mean and spread are reported).
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    reps: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    model: String,
    size_mib: usize,
    device: String,
    test: String,
    tokens_per_s: f64,
    stddev: f64,
}

/// Random but valid token ids (a fixed LCG, so runs compare).
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// llama-bench's test names: `pp512`, `tg128 @ d4096`.
fn test_name(kind: &str, n: usize, depth: usize) -> String {
    match depth {
        0 => format!("{kind}{n}"),
        d => format!("{kind}{n} @ d{d}"),
    }
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64;
    (m, var.sqrt())
}

/// A cache of `cap` positions holding `depth` random tokens (prefilled).
fn cache_at_depth(model: &Llama, cap: usize, depth: usize) -> anygpu_core::Result<KvCache> {
    let mut cache = model.new_cache(cap)?;
    if depth > 0 {
        anygpu_models::generate::prefill(model, &mut cache, &tokens(depth, model.config.n_vocab, 99))?;
    }
    Ok(cache)
}

/// Prefill speed over `n` tokens after the `depth` positions `cache` holds (rewound to them
/// first, as llama-bench clears its context's cache between repetitions: a new cache each time
/// would also time the first use of freshly allocated device memory).
fn pp(model: &Llama, cache: &mut KvCache, n: usize, depth: usize, seed: u64) -> anygpu_core::Result<f64> {
    let ids = tokens(n, model.config.n_vocab, seed);
    cache.truncate(depth);
    let t0 = Instant::now();
    anygpu_models::generate::prefill(model, cache, &ids)?;
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}

/// Decode speed over `n` tokens after the `depth` positions `cache` holds (rewound to them
/// first, as for [`pp`]: every repetition replays the one recording of the decode step, as
/// llama-bench's repetitions reuse one graph, and writes into memory an earlier run has used;
/// a cache per repetition had timed each one's first use of freshly allocated memory). A timed
/// run (not a warm-up) prints where its steps' time went.
fn tg(model: &Llama, cache: &mut KvCache, n: usize, depth: usize, seed: u64, timed: bool) -> anygpu_core::Result<f64> {
    cache.truncate(depth);
    let mut id = tokens(1, model.config.n_vocab, seed)[0];
    // Recording the decode step is a one-off per cache (like building llama.cpp's graph).
    model.prepare_decode(cache);
    let before = cache.decode_stats().unwrap_or_default();
    let t0 = Instant::now();
    let rate = if std::env::var("ANYGPU_GREEDY_ON_GPU").is_ok_and(|v| v == "0") {
        // The step-by-step path: logits back to the host, argmax there (for comparisons).
        for _ in 0..n {
            let logits = model.decode(id, cache)?;
            id = anygpu_models::sampling::argmax(&logits).unwrap_or(0) as u32;
        }
        n as f64 / t0.elapsed().as_secs_f64()
    } else {
        // Greedy decoding as `generate --temp 0` runs it: the argmax on the GPU, two steps in flight.
        let made = model.decode_greedy(id, n, cache, &mut |_| true)?;
        made as f64 / t0.elapsed().as_secs_f64()
    };
    if !timed {
        return Ok(rate);
    }
    if std::env::var("ANYGPU_PROFILE_DECODE").is_ok_and(|v| v == "1") {
        print_profile("decode step", cache.profile_decode()?);
    }
    // This repetition's steps only (the cache's sums run over all of them).
    if let Some(s) = cache.decode_stats().map(|s| s.since(&before)).filter(|s| s.steps > 0) {
        let ms = |v: f64| v * 1e3 / s.steps as f64;
        eprintln!(
            "anygpu: decode step replayed: {} dispatches; per token {:.3} ms in all; from its start, a run (greedy: up to \
             {} steps) was encoded by {:.3}, submitted by {:.3} and done by {:.3} ms (it queues behind the run before); GPU \
             pass {:.3} ms per step",
            s.dispatches,
            ms(s.total_s),
            anygpu_core::gpu::MAX_STEPS_PER_RUN,
            ms(s.encode_s),
            ms(s.submitted_s),
            ms(s.waited_s),
            ms(s.gpu_s)
        );
    }
    Ok(rate)
}

/// One more prefill of `n` tokens with each dispatch timed on its own (`ANYGPU_PROFILE_PREFILL=1`),
/// printed per op and grid on stderr.
fn profile_prefill(model: &Llama, n: usize) -> anygpu_core::Result<()> {
    let Some(g) = model.device().gpu() else { return Ok(()) };
    let mut cache = model.new_cache(n)?;
    let ((), ops) = g.profile_dispatches(|| pp(model, &mut cache, n, 0, 0).map(|_| ()))?;
    print_profile(&format!("prefill of {n} tokens"), ops);
    Ok(())
}

/// A profile's table on stderr: op and grid, dispatches, µs, share.
fn print_profile(what: &str, ops: Option<Vec<(String, usize, f64)>>) {
    let Some(ops) = ops else {
        eprintln!("anygpu: {what}: no profile (the device has no timestamp queries)");
        return;
    };
    let total: f64 = ops.iter().map(|o| o.2).sum();
    eprintln!("anygpu: {what}, GPU time by op (one pass per dispatch, {:.3} ms in all):", total * 1e3);
    for (op, count, s) in ops {
        eprintln!("  {op:<40} {count:>4} dispatches {:>9.1} µs {:>5.1}%", s * 1e6, 100.0 * s / total);
    }
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    if args.reps == 0 {
        return Err(CliError::usage("--repetitions must be at least 1"));
    }
    if args.n_prompt == 0 && args.n_gen == 0 {
        return Err(CliError::usage("nothing to measure: -p (prompt tokens) and -n (generated tokens) are both 0"));
    }
    let mut margs = args.model.clone();
    let depth = args.n_depth;
    margs.ctx_size = Some(margs.ctx_size.unwrap_or(0).max(depth + args.n_prompt.max(args.n_gen + 1)).max(1));
    let lm = load(device, &margs, args.json)?;
    let name = args.model.model.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let dev = describe(lm.model.device());
    let reps = args.reps;
    let mut rows = Vec::new();
    // Untimed runs of each test first: the first compiles the pipelines and warms the pools
    // (at the full prompt length, as llama-bench's warm-up: the kernels' tile choices depend on
    // the token count), and more follow until the device has worked for half a second, so that
    // a GPU whose clocks dropped while the model loaded is back at speed (see
    // anygpu_core::bench::warm_up).
    let model_device = lm.model.device();
    if args.n_prompt > 0 {
        let mut cache = cache_at_depth(&lm.model, depth + args.n_prompt, depth)?;
        warm_up(model_device, || pp(&lm.model, &mut cache, args.n_prompt, depth, 0))?;
        let v = (0..reps)
            .map(|r| pp(&lm.model, &mut cache, args.n_prompt, depth, r as u64 + 1))
            .collect::<anygpu_core::Result<Vec<_>>>()?;
        let (m, sd) = mean_sd(&v);
        if let Some((bytes, reserved)) = lm.model.device().gpu().and_then(|g| g.memory_use()) {
            eprintln!(
                "anygpu: GPU memory after the prefill: {} MiB allocated in {} MiB of blocks (its pooled buffers included)",
                bytes >> 20,
                reserved >> 20
            );
        }
        if std::env::var("ANYGPU_PROFILE_PREFILL").is_ok_and(|v| v == "1") {
            profile_prefill(&lm.model, args.n_prompt)?;
        }
        rows.push(Row {
            model: name.clone(),
            size_mib: lm.model.weight_bytes() >> 20,
            device: dev.clone(),
            test: test_name("pp", args.n_prompt, depth),
            tokens_per_s: m,
            stddev: sd,
        });
    }
    if args.n_gen > 0 {
        // As `generate` does after its prefill: the pooled prefill activations are freed.
        if let Some(g) = lm.model.device().gpu() {
            g.release_pooled()?;
        }
        // `-c` sets the decode test's cache (default: just the generated tokens, n + 1; the
        // attention plans its key splits on the cache's capacity). The untimed warm-up is
        // whole runs: the first records the step.
        let ctx = args.model.ctx_size.unwrap_or(0);
        let mut cache = cache_at_depth(&lm.model, ctx.max(depth + args.n_gen + 1), depth)?;
        warm_up(model_device, || tg(&lm.model, &mut cache, args.n_gen, depth, 0, false))?;
        let v = (0..reps)
            .map(|r| tg(&lm.model, &mut cache, args.n_gen, depth, r as u64 + 1, true))
            .collect::<anygpu_core::Result<Vec<_>>>()?;
        let (m, sd) = mean_sd(&v);
        rows.push(Row {
            model: name.clone(),
            size_mib: lm.model.weight_bytes() >> 20,
            device: dev.clone(),
            test: test_name("tg", args.n_gen, depth),
            tokens_per_s: m,
            stddev: sd,
        });
    }
    if let Some((bytes, reserved)) = lm.model.device().gpu().and_then(|g| g.memory_use()) {
        let file = std::fs::metadata(&args.model.model).map(|m| m.len()).unwrap_or(0);
        let kv = anygpu_models::llama::KvCache::bytes_for(&lm.model.config, margs.ctx_size.unwrap_or(1));
        eprintln!(
            "anygpu: GPU memory allocated: {} MiB in {} MiB of blocks (file {} MiB, a {}-position KV cache {} MiB; pooled buffers included, \
             those of the prefill released before the decode runs as `generate` does)",
            bytes >> 20,
            reserved >> 20,
            file >> 20,
            margs.ctx_size.unwrap_or(1),
            kv >> 20
        );
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("| model | size | device | test | t/s |\n| --- | ---: | --- | ---: | ---: |");
        for r in &rows {
            println!(
                "| {} | {} MiB | {} | {} | {:.2} ± {:.2} |",
                r.model, r.size_mib, r.device, r.test, r.tokens_per_s, r.stddev
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

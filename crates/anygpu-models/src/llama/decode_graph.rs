//! The decode step as a replay of prepared dispatches: one token's forward pass is recorded
//! once per KV cache (at three positions, so that the position-dependent parameters are found
//! and checked, see `anygpu_core::gpu::replay`) and then issued for every new token with one
//! submit: the token id and the patched parameters are written, the recorded dispatches run,
//! the logits come back. Set `ANYGPU_DECODE_GRAPH=0` to run every step through the per-op
//! path instead (for comparisons; the results are the same).
//!
//! The recorded step ends with the argmax of its logits written where the embedding lookup
//! reads the token id. Sampled decoding overwrites that id with the host's choice before each
//! step; greedy decoding ([`Llama::decode_greedy`]) leaves it, so the GPU chains steps without
//! the host: runs of 1, 2, 4 then 8 steps per submit (one compute pass each), two runs in
//! flight, only the 4-byte ids read back, not the logits.
//!
//! A cache longer than `Llama::first_stage_keys` positions (256 where the decode attention
//! kernel runs, else 160) gets two recordings: one for its first positions, whose attention is
//! planned for that many keys (a short cache is walked unsplit, with no merge:
//! `AttentionOpts::max_keys`), and one for every position (the
//! attention then splits the keys for the cache's capacity), each recorded when a step first
//! needs it (a conversation that starts past the first positions never records them). Both read
//! and write the same token id, so greedy runs chain across them.

use std::sync::Arc;

use std::collections::VecDeque;

use anygpu_core::gpu::{next_run_steps, GpuContext, Replay, ReplayTimes};
use anygpu_core::ops::reduce::gpu_argmax_into;
use anygpu_core::quant::gpu::gather_rows_by_buffer;
use anygpu_core::{DType, Error, Result, Tensor};

use super::kv_cache::KvCache;
use super::model::Llama;

pub struct DecodeGraph {
    /// The recording for positions below `Llama::first_stage_keys`, when the cache is longer
    /// (made when a step first needs it, as `all`).
    first: Option<Stage>,
    /// The recording for every position.
    all: Option<Stage>,
    /// The token id the recorded embedding lookups read (and the argmax writes): u32 [1].
    ids: Tensor,
    /// The model the recording belongs to (its weights are bound).
    model_id: u64,
    stats: DecodeStats,
}

/// One recording of the decode step, valid for positions below `end`.
struct Stage {
    replay: Replay,
    /// The recorded logits [1, V].
    logits: Tensor,
    end: usize,
}

/// Which stage a position runs on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Which {
    First,
    All,
}

/// Sums over the steps run so far (see [`KvCache::decode_stats`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeStats {
    /// Dispatches per step (of the recording the last step ran).
    pub dispatches: usize,
    pub steps: usize,
    pub encode_s: f64,
    /// GPU time of the replayed passes (0 without timestamp queries).
    pub gpu_s: f64,
    pub total_s: f64,
    /// Until the submit returned / until the wait for the GPU returned.
    pub submitted_s: f64,
    pub waited_s: f64,
}

impl DecodeStats {
    /// The steps run since `earlier` (an earlier reading of the same sums).
    pub fn since(&self, earlier: &DecodeStats) -> DecodeStats {
        DecodeStats {
            dispatches: self.dispatches,
            steps: self.steps.saturating_sub(earlier.steps),
            encode_s: self.encode_s - earlier.encode_s,
            gpu_s: self.gpu_s - earlier.gpu_s,
            total_s: self.total_s - earlier.total_s,
            submitted_s: self.submitted_s - earlier.submitted_s,
            waited_s: self.waited_s - earlier.waited_s,
        }
    }

    /// Counts one step: the times of the run it was in (the GPU time shared by its steps),
    /// `per_token_s` of wall time.
    fn add(&mut self, t: ReplayTimes, per_token_s: f64) {
        self.steps += 1;
        self.encode_s += t.encode_s;
        self.submitted_s += t.submitted_s;
        self.waited_s += t.waited_s;
        self.gpu_s += t.gpu_s.unwrap_or(0.0) / t.steps.max(1) as f64;
        self.total_s += per_token_s;
    }
}

/// `ANYGPU_DECODE_FIRST=0` (read once): one recording for every position, as before the first
/// positions had their own (for comparisons).
fn first_stage_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("ANYGPU_DECODE_FIRST").is_ok_and(|v| v == "0"))
}

/// Whether decode steps use the recorded graph (default on; `ANYGPU_DECODE_GRAPH=0` turns it off).
pub fn enabled() -> bool {
    std::env::var("ANYGPU_DECODE_GRAPH").map(|v| v != "0").unwrap_or(true)
}

impl DecodeGraph {
    /// Records the decode step of `model` on `cache` (whose length is left as it was) for the
    /// cache's position: the first positions' stage or the all-positions one (see the module
    /// docs; the other is recorded when a step first needs it).
    pub fn build(model: &Llama, cache: &mut KvCache) -> Result<DecodeGraph> {
        let ids = Tensor::zeros([1], DType::U32, model.device())?;
        let mut g = DecodeGraph { first: None, all: None, ids, model_id: model.id(), stats: DecodeStats::default() };
        let w = g.stage_for(model, cache, cache.len())?;
        g.stage(w)?;
        Ok(g)
    }

    /// The stage that runs position `pos`, recorded now if it was not yet: the first
    /// positions' one below `Llama::first_stage_keys` of a longer cache, else the all-positions
    /// one.
    fn stage_for(&mut self, model: &Llama, cache: &mut KvCache, pos: usize) -> Result<Which> {
        let short = model.first_stage_keys();
        if cache.capacity() > short && pos < short && !first_stage_off() {
            if self.first.is_none() {
                self.first = Some(Stage::record(model, cache, &self.ids, short)?);
            }
            return Ok(Which::First);
        }
        if self.all.is_none() {
            self.all = Some(Stage::record(model, cache, &self.ids, cache.capacity())?);
        }
        Ok(Which::All)
    }

    fn stage(&mut self, w: Which) -> Result<&mut Stage> {
        let stage = match w {
            Which::First => self.first.as_mut(),
            Which::All => self.all.as_mut(),
        }
        .ok_or_else(|| Error::gpu("decode graph", "stage not recorded"))?;
        self.stats.dispatches = stage.replay.len();
        Ok(stage)
    }

    pub fn belongs_to(&self, model: &Llama) -> bool {
        self.model_id == model.id()
    }

    /// GPU time per op of one decode step at the cache's position (see `Replay::profile`).
    /// (The stage that covers the position, or the recorded one at its last position.)
    pub fn profile(&mut self, cache: &KvCache) -> Result<Option<Vec<(String, usize, f64)>>> {
        let pos = cache.len().min(cache.capacity().saturating_sub(1));
        let stage = match (&mut self.first, &mut self.all) {
            (Some(f), _) if pos < f.end => f,
            (_, Some(a)) => a,
            (Some(f), None) => f,
            (None, None) => return Ok(None),
        };
        stage.replay.profile(pos.min(stage.end - 1) as u32)
    }

    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Greedy decoding from `first` at position `cache.len()`: up to `max` tokens, each passed
    /// to `on_token` once its run is back (false stops). A run chains up to
    /// `MAX_STEPS_PER_RUN` steps in one submit (the GPU feeds each step's token to the next);
    /// two runs are in flight at a time, and steps submitted past a stop are rolled back from
    /// the cache. Returns the tokens made.
    pub fn greedy(
        &mut self,
        model: &Llama,
        first: u32,
        max: usize,
        cache: &mut KvCache,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        let n_vocab = model.config.n_vocab;
        if first as usize >= n_vocab {
            return Err(Error::Index { op: "token id", index: first as i64, len: n_vocab });
        }
        let ids = self.ids.clone();
        let idbuf = ids.gpu_buffer().ok_or_else(|| Error::mismatch("decode graph", "ids not on the GPU"))?;
        // (ticket, steps, stage) of the runs in flight, and the steps of the run being handed
        // out that the host has not seen yet: all of them are in the cache already.
        let mut in_flight = VecDeque::new();
        let mut unseen = 0;
        let (mut submitted, mut made) = (0, 0);
        // Runs of 1, 2, 4, ... steps (see `next_run_steps`).
        let mut run_steps = 1;
        let mut last = std::time::Instant::now();
        let result = (|| -> Result<()> {
            loop {
                while submitted < max && in_flight.len() < 2 {
                    // A run stays within one stage (the first one's end cuts it short).
                    let which = self.stage_for(model, cache, cache.len())?;
                    let end = self.stage(which)?.end;
                    let room = end.saturating_sub(cache.len());
                    let steps = (max - submitted).min(run_steps).min(room.max(1));
                    run_steps = next_run_steps(run_steps);
                    model.check_room(cache, steps)?;
                    let pos =
                        u32::try_from(cache.len()).map_err(|_| Error::shape("decode graph", "position exceeds u32"))?;
                    let first_bytes = first.to_le_bytes();
                    let inputs: &[(&anygpu_core::gpu::GpuBuffer, &[u8])] =
                        if submitted == 0 { &[(idbuf, &first_bytes)] } else { &[] };
                    let ticket = self.stage(which)?.replay.submit_steps(pos, steps, inputs, idbuf, 4)?;
                    in_flight.push_back((ticket, steps, which));
                    cache.advance(steps);
                    submitted += steps;
                }
                let Some((ticket, steps, which)) = in_flight.pop_front() else { return Ok(()) };
                let bytes = self.stage(which)?.replay.wait(ticket)?;
                let times = self.stage(which)?.replay.last_times();
                unseen = steps;
                // A run's own time overlaps its neighbours': per token is the time between runs
                // over the tokens they made.
                let per_token = last.elapsed().as_secs_f64() / steps as f64;
                last = std::time::Instant::now();
                for id in bytes.chunks_exact(4).take(steps) {
                    let token = u32::from_le_bytes([id[0], id[1], id[2], id[3]]);
                    made += 1;
                    unseen -= 1;
                    self.stats.add(times, per_token);
                    if !on_token(token) {
                        return Ok(());
                    }
                }
            }
        })();
        // Steps the host did not take (after a stop or an error) are waited for and forgotten.
        let mut forget = unseen;
        for (ticket, steps, which) in in_flight.drain(..) {
            if let Ok(stage) = self.stage(which) {
                let _ = stage.replay.wait(ticket);
            }
            forget += steps;
        }
        cache.truncate(cache.len().saturating_sub(forget));
        result.map(|()| made)
    }

    /// Runs `token` at position `cache.len()` and returns the logits [V]; advances the cache.
    pub fn step(&mut self, model: &Llama, token: u32, cache: &mut KvCache) -> Result<Vec<f32>> {
        model.check_room(cache, 1)?;
        let n_vocab = model.config.n_vocab;
        if token as usize >= n_vocab {
            return Err(Error::Index { op: "token id", index: token as i64, len: n_vocab });
        }
        let pos = u32::try_from(cache.len()).map_err(|_| Error::shape("decode graph", "position exceeds u32"))?;
        let which = self.stage_for(model, cache, cache.len())?;
        let ids = self.ids.clone();
        let idbuf = ids.gpu_buffer().ok_or_else(|| Error::mismatch("decode graph", "ids not on the GPU"))?;
        let stage = self.stage(which)?;
        let out = stage.logits.gpu_buffer().ok_or_else(|| Error::mismatch("decode graph", "logits not on the GPU"))?;
        let bytes = stage.replay.run(pos, &[(idbuf, &token.to_le_bytes())], out, (n_vocab * 4) as u64)?;
        cache.advance(1);
        let times = stage.replay.last_times();
        self.stats.add(times, times.total_s);
        Ok(bytemuck::cast_slice::<u8, f32>(&bytes[..n_vocab * 4]).to_vec())
    }
}

impl Stage {
    /// Records the decode step of `model` on `cache` for positions below `end` (the cache's
    /// capacity, or fewer: the attention is then planned for `end` keys), reading and writing
    /// the token id in `ids`; the cache's length is left as it was.
    fn record(model: &Llama, cache: &mut KvCache, ids: &Tensor, end: usize) -> Result<Stage> {
        let ctx: Arc<GpuContext> =
            model.device().gpu().ok_or_else(|| Error::mismatch("decode graph", "the model is not on a GPU"))?.clone();
        let end = end.min(cache.capacity());
        if end < 3 {
            return Err(Error::shape("decode graph", "the context is too short to record a decode step"));
        }
        let idbuf = ids.gpu_buffer().ok_or_else(|| Error::mismatch("decode graph", "ids not on the GPU"))?;
        let len = cache.len();
        cache.attention_horizon = Some(end);
        // Three distinct positions: two to fit the parameters, the last one to check the fit.
        let positions = [0, 1, end - 1];
        let recorded: Result<Vec<_>> = positions
            .iter()
            .map(|&p| {
                cache.set_len(p);
                let (out, rec) = ctx.record(|| {
                    let x = gather_rows_by_buffer(model.token_embd(), idbuf, 1)?;
                    let logits = model.forward_embedded(x, cache, false)?;
                    // The greedy choice becomes the next step's input (see the module docs).
                    gpu_argmax_into(&logits, ids)?;
                    Ok(logits)
                })?;
                Ok((out, (p as u32, rec)))
            })
            .collect();
        cache.set_len(len);
        cache.attention_horizon = None;
        let (outs, recs): (Vec<Tensor>, Vec<_>) = recorded?.into_iter().unzip();
        let replay = Replay::new(&ctx, recs)?;
        // The first recording's buffers are the replayed ones: its logits are the output.
        let logits = outs.into_iter().next().ok_or_else(|| Error::gpu("decode graph", "nothing was recorded"))?;
        Ok(Stage { replay, logits, end })
    }
}

impl Llama {
    /// Greedy decoding from `first` at position `cache.len()`: up to `max` tokens, each given
    /// to `on_token` as it is known (returning false stops; the cache then holds exactly the
    /// tokens fed, `first` and those before the stop). On a GPU the recorded step runs two
    /// tokens ahead of the host (see the module docs); elsewhere one step at a time.
    /// Returns the number of tokens made.
    pub fn decode_greedy(
        &self,
        first: u32,
        max: usize,
        cache: &mut KvCache,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        if self.prepare_decode(cache) {
            if let Some(mut g) = cache.graph.take() {
                let out = g.greedy(self, first, max, cache, on_token);
                cache.graph = Some(g);
                return out;
            }
        }
        let mut token = first;
        for made in 0..max {
            let logits = self.decode(token, cache)?;
            token = crate::sampling::argmax(&logits).unwrap_or(0) as u32;
            if !on_token(token) {
                return Ok(made + 1);
            }
        }
        Ok(max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_since_an_earlier_reading_count_only_the_steps_after_it() {
        let mut s = DecodeStats::default();
        let t = |gpu| ReplayTimes {
            encode_s: 1.0,
            gpu_s: Some(gpu),
            total_s: 9.0,
            submitted_s: 2.0,
            waited_s: 3.0,
            steps: 2,
        };
        s.add(t(4.0), 0.5);
        let earlier = s;
        s.add(t(8.0), 0.25);
        s.add(t(8.0), 0.25);
        let d = s.since(&earlier);
        assert_eq!(d.steps, 2);
        assert_eq!((d.encode_s, d.submitted_s, d.waited_s), (2.0, 4.0, 6.0));
        // Each step's share of its run's GPU time: 8 / 2 twice.
        assert_eq!(d.gpu_s, 8.0);
        assert_eq!(d.total_s, 0.5);
    }
}

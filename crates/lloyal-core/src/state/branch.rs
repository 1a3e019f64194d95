//! `Branch.save_state` / `Branch.load_state`: one verified blob holding a branch's KV cells,
//! position, sampler (parameters, penalty history, RNG), grammar (rules and accepted tokens),
//! perplexity trackers, biases and logits, so the branch resumes in another process.
//!
//! Layout (little-endian): `LLOYALBR` | version u32 | meta length u64 | meta (JSON) |
//! logits count u64 | logits f32... | KV length u64 | KV (a `kv_cache_save` blob, which
//! carries the model fingerprint) | FNV-1a 64 checksum of everything before it.
//! Everything is checked before a lease is taken or a cell is written.
//!
//! Not restorable exactly: the internal RNG of XTC and the running `mu` of mirostat (llama.cpp
//! keeps them private); those restart from their seed.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::branch::{BranchState, Logits};
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::grammar::{GbnfEngineChoice, Grammar, GrammarKind, GrammarSource};
use crate::metrics::PerplexityTracker;
use crate::model::Model;
use crate::sampler::Sampler;
use crate::sampling::{Dry, Mirostat, SamplingParams, Xtc};
use crate::state::envelope::{self, fnv1a64};
use crate::state::kv::fingerprint;
use crate::tenancy::Handle;

const MAGIC: &[u8; 8] = b"LLOYALBR";
const VERSION: u32 = 1;

fn bad(what: impl std::fmt::Display) -> LloyalError {
    LloyalError::State(format!("cannot load branch state: {what}"))
}

fn params_to_json(p: &SamplingParams) -> Value {
    json!({
        "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
        "typical_p": p.typical_p, "repeat_penalty": p.repeat_penalty,
        "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
        "penalty_last_n": p.penalty_last_n, "seed": p.seed,
        "mirostat": p.mirostat.as_ref().map(|m| json!({"version": m.version, "tau": m.tau, "eta": m.eta})),
        "dry": p.dry.as_ref().map(|d| json!({
            "multiplier": d.multiplier, "base": d.base, "allowed_length": d.allowed_length,
            "penalty_last_n": d.penalty_last_n, "sequence_breakers": d.sequence_breakers,
        })),
        "xtc": p.xtc.as_ref().map(|x| json!({
            "probability": x.probability, "threshold": x.threshold, "min_keep": x.min_keep,
        })),
    })
}

fn f32_of(v: &Value, key: &str) -> Result<f32> {
    v.get(key).and_then(Value::as_f64).map(|x| x as f32).ok_or_else(|| bad(format!("missing number {key:?}")))
}

fn i64_of(v: &Value, key: &str) -> Result<i64> {
    v.get(key).and_then(Value::as_i64).ok_or_else(|| bad(format!("missing integer {key:?}")))
}

fn i32_of(v: &Value, key: &str) -> Result<i32> {
    i32::try_from(i64_of(v, key)?).map_err(|_| bad(format!("{key:?} out of range")))
}

fn params_from_json(v: &Value) -> Result<SamplingParams> {
    let opt = |key: &str| v.get(key).filter(|x| !x.is_null());
    let mirostat = opt("mirostat")
        .map(|m| {
            Ok::<_, LloyalError>(Mirostat {
                version: u8::try_from(i64_of(m, "version")?).map_err(|_| bad("mirostat version"))?,
                tau: f32_of(m, "tau")?,
                eta: f32_of(m, "eta")?,
            })
        })
        .transpose()?;
    let dry = opt("dry")
        .map(|d| {
            let breakers = d
                .get("sequence_breakers")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("dry sequence_breakers"))?
                .iter()
                .map(|b| b.as_str().map(str::to_string).ok_or_else(|| bad("dry sequence breaker")))
                .collect::<Result<Vec<_>>>()?;
            Ok::<_, LloyalError>(Dry {
                multiplier: f32_of(d, "multiplier")?,
                base: f32_of(d, "base")?,
                allowed_length: i32_of(d, "allowed_length")?,
                penalty_last_n: i32_of(d, "penalty_last_n")?,
                sequence_breakers: breakers,
            })
        })
        .transpose()?;
    let xtc = opt("xtc")
        .map(|x| {
            Ok::<_, LloyalError>(Xtc {
                probability: f32_of(x, "probability")?,
                threshold: f32_of(x, "threshold")?,
                min_keep: usize::try_from(i64_of(x, "min_keep")?).map_err(|_| bad("xtc min_keep"))?,
            })
        })
        .transpose()?;
    let seed = match opt("seed") {
        None => None,
        Some(s) => Some(s.as_u64().and_then(|s| u32::try_from(s).ok()).ok_or_else(|| bad("seed"))?),
    };
    let params = SamplingParams {
        temperature: f32_of(v, "temperature")?,
        top_k: i32_of(v, "top_k")?,
        top_p: f32_of(v, "top_p")?,
        min_p: f32_of(v, "min_p")?,
        typical_p: f32_of(v, "typical_p")?,
        repeat_penalty: f32_of(v, "repeat_penalty")?,
        frequency_penalty: f32_of(v, "frequency_penalty")?,
        presence_penalty: f32_of(v, "presence_penalty")?,
        penalty_last_n: i32_of(v, "penalty_last_n")?,
        seed,
        mirostat,
        dry,
        xtc,
    };
    params.validate().map_err(|e| bad(format!("invalid sampling parameters ({e})")))?;
    Ok(params)
}

fn tokens_of(v: &Value, key: &str) -> Result<Vec<i32>> {
    v.get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| bad(format!("missing list {key:?}")))?
        .iter()
        .map(|t| {
            t.as_i64().and_then(|t| i32::try_from(t).ok()).ok_or_else(|| bad(format!("bad token in {key:?}")))
        })
        .collect()
}

fn pairs_of(v: &Value, key: &str) -> Result<Vec<(i32, f32)>> {
    let err = || bad(format!("bad list {key:?}"));
    v.get(key)
        .and_then(Value::as_array)
        .ok_or_else(err)?
        .iter()
        .map(|p| {
            let t = p.get(0).and_then(Value::as_i64).and_then(|t| i32::try_from(t).ok()).ok_or_else(err)?;
            // JSON has no -inf: a banned token is stored as null.
            let b = match p.get(1) {
                Some(Value::Null) => f32::NEG_INFINITY,
                Some(x) => x.as_f64().ok_or_else(err)? as f32,
                None => return Err(err()),
            };
            Ok((t, b))
        })
        .collect()
}

fn tracker_to_json(t: &PerplexityTracker) -> Value {
    json!([t.sum_nats(), t.count()])
}

fn tracker_of(v: &Value, key: &str) -> Result<PerplexityTracker> {
    let err = || bad(format!("bad tracker {key:?}"));
    let a = v.get(key).and_then(Value::as_array).ok_or_else(err)?;
    // JSON has no infinity: a sum that reached it (the surprisal of a token banned with -inf)
    // is stored as null.
    let sum = match a.first() {
        Some(Value::Null) => f64::INFINITY,
        other => other.and_then(Value::as_f64).ok_or_else(err)?,
    };
    let count = a.get(1).and_then(Value::as_u64).ok_or_else(err)?;
    Ok(PerplexityTracker::from_parts(sum, count))
}

/// A cursor over the blob with bounds-checked reads.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end =
            self.at.checked_add(n).filter(|&e| e <= self.data.len()).ok_or_else(|| bad("truncated data"))?;
        let out = &self.data[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
    }

    fn len(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?).map_err(|_| bad("section too large"))
    }
}

/// Everything parsed and checked from a blob, before any lease or cell is touched.
struct Parsed {
    position: i32,
    sampler: Sampler,
    grammar: Option<Grammar>,
    model_ppl: PerplexityTracker,
    sampling_ppl: PerplexityTracker,
    logit_bias: Vec<(i32, f32)>,
    steer: Vec<(i32, f32)>,
    logits: Vec<f32>,
    kv: Vec<u8>,
    cells: usize,
}

impl ContextState {
    /// `Branch.save_state()`: the branch as a verified byte string.
    pub fn branch_save(&mut self, handle: Handle) -> Result<Vec<u8>> {
        let b = self.branch(handle)?;
        let (seq, position) = (b.seq_id, b.position);
        let grammar = b.grammar.as_ref().map(|g| {
            let src = g.source();
            let mut saved =
                json!({"kind": src.kind.name(), "text": src.text, "root": src.root, "accepted": g.accepted()});
            if src.engine != GbnfEngineChoice::Auto {
                saved["engine"] = json!(src.engine.name());
            }
            saved
        });
        let bias = |v: &[(i32, f32)]| {
            Value::Array(
                v.iter()
                    .map(|&(t, x)| if x.is_finite() { json!([t, x]) } else { json!([t, null]) })
                    .collect(),
            )
        };
        let meta = json!({
            "position": position,
            "params": params_to_json(b.sampler.params()),
            "history": b.sampler.history(),
            "rng": b.sampler.rng_state().to_string(),
            "model_ppl": tracker_to_json(&b.model_ppl),
            "sampling_ppl": tracker_to_json(&b.sampling_ppl),
            "logit_bias": bias(&b.logit_bias),
            "steer": bias(&b.steer),
            "grammar": grammar,
        });
        let meta = meta.to_string().into_bytes();
        let logits = Arc::clone(&b.logits);
        let kv = self.kv_save(seq)?;
        let mut out = Vec::with_capacity(40 + meta.len() + logits.len() * 4 + kv.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
        for x in logits.iter() {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        out.extend_from_slice(&kv);
        let sum = fnv1a64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    fn parse_branch_state(&self, data: &[u8]) -> Result<Parsed> {
        let (meta, logits, kv) = read_sections(data)?;
        let model = self.model();
        if !logits.is_empty() && logits.len() != model.n_vocab() as usize {
            return Err(bad(format!(
                "{} logits stored, the model has n_vocab={}",
                logits.len(),
                model.n_vocab()
            )));
        }
        let kv_state = envelope::decode(&fingerprint(&model), &kv)?;
        let position = i32_of(&meta, "position")?;
        // (a branch with no cells may stand anywhere a new one may: Branch.create(position=))
        let fits = if kv_state.pos_max >= 0 {
            position == kv_state.pos_max + 1
        } else {
            (0..=crate::branch::ops::MAX_START).contains(&position)
        };
        if !fits {
            return Err(bad(format!("position {position} does not follow the stored cells")));
        }
        let params = params_from_json(meta.get("params").ok_or_else(|| bad("missing params"))?)?;
        let history = tokens_of(&meta, "history")?;
        let rng: u64 =
            meta.get("rng").and_then(Value::as_str).and_then(|s| s.parse().ok()).ok_or_else(|| bad("rng"))?;
        let sampler = Sampler::restore(&model, params, history, rng).map_err(bad)?;
        let grammar = grammar_of(&meta, &model)?;
        let logit_bias = pairs_of(&meta, "logit_bias")?;
        let steer = pairs_of(&meta, "steer")?;
        for &(t, _) in logit_bias.iter().chain(&steer) {
            model.check_token(i64::from(t)).map_err(bad)?;
        }
        let cells =
            super::window::payload_cells(&model, &kv_state.payload, kv_state.pos_min, kv_state.pos_max);
        Ok(Parsed {
            position,
            sampler,
            grammar,
            model_ppl: tracker_of(&meta, "model_ppl")?,
            sampling_ppl: tracker_of(&meta, "sampling_ppl")?,
            logit_bias,
            steer,
            logits,
            kv,
            cells,
        })
    }

    /// `Branch.load_state(ctx, data)`: a new root branch from a saved state (takes a lease).
    /// Bad data → `StateError` before anything is touched; a failure while writing the cells
    /// empties the new sequence and returns the lease.
    pub fn branch_load(&mut self, data: &[u8]) -> Result<Handle> {
        let p = self.parse_branch_state(data)?;
        let tracks_sampling = self.sampling_perplexity;
        let kv = p.kv;
        let (cells, start) = (p.cells, p.position - p.cells as i32);
        let handle = self.new_root(
            cells,
            |s, seq| s.kv_load_unchecked(seq, &kv).map(drop),
            |seq| {
                let mut b = BranchState::new(seq, p.position, p.sampler, tracks_sampling);
                b.fork_head = p.position - p.cells as i32;
                b.grammar = p.grammar;
                b.model_ppl = p.model_ppl;
                b.sampling_ppl = p.sampling_ppl;
                b.logit_bias = p.logit_bias;
                b.steer = p.steer;
                b.logits = Arc::new(Logits::new(p.logits));
                b
            },
        )?;
        let seq = self.branch(handle)?.seq_id;
        self.note_window(handle, seq, start);
        Ok(handle)
    }

    /// A new root branch on a free lease, its `cells` cells written by `write` (room made for
    /// them first) and its state `branch(seq)`: a loaded branch state, a prefix cache entry
    /// written back from host memory. A failed write empties the sequence and returns the lease.
    pub(crate) fn new_root(
        &mut self,
        cells: usize,
        write: impl FnOnce(&mut Self, i32) -> Result<()>,
        branch: impl FnOnce(i32) -> BranchState,
    ) -> Result<Handle> {
        let seq = self.root_lease(cells, write)?;
        Ok(self.root_insert(branch(seq), cells))
    }

    /// [`Self::new_root`]'s first half: room made for `cells` cells, a free lease taken and its
    /// cells written by `write`; on failure nothing is taken.
    pub(crate) fn root_lease(
        &mut self,
        cells: usize,
        write: impl FnOnce(&mut Self, i32) -> Result<()>,
    ) -> Result<i32> {
        self.cache_make_room(1, cells, 0, &[]);
        self.check_room(cells)?;
        let seq = self.ledger.take_lease(&mut self.raw)?;
        self.remove_cells(seq, -1, -1);
        if let Err(e) = write(self, seq) {
            self.remove_cells(seq, -1, -1);
            self.ledger.return_lease(seq);
            return Err(e);
        }
        Ok(seq)
    }

    /// [`Self::new_root`]'s second half: `state` (on the lease [`Self::root_lease`] took) as a
    /// root branch holding its `cells` cells.
    pub(crate) fn root_insert(&mut self, state: BranchState, cells: usize) -> Handle {
        let handle = self.branches.insert(state);
        self.topology.add(handle, None);
        self.ledger.grow_cells(cells);
        handle
    }
}

/// The sections of a saved branch state, checked: its metadata, logits and KV envelope.
fn read_sections(data: &[u8]) -> Result<(Value, Vec<f32>, Vec<u8>)> {
    if data.len() < MAGIC.len() + 4 + 8 || &data[..MAGIC.len()] != MAGIC {
        return Err(bad("not a lloyal branch state (bad magic); pass bytes from Branch.save_state()"));
    }
    let (body, sum) = data.split_at(data.len() - 8);
    let mut r = Reader { data: body, at: MAGIC.len() };
    let version = u32::from_le_bytes(r.take(4)?.try_into().map_err(|_| bad("truncated data"))?);
    if version != VERSION {
        return Err(bad(format!("format version {version}, this lloyal reads version {VERSION}")));
    }
    if u64::from_le_bytes(sum.try_into().map_err(|_| bad("truncated data"))?) != fnv1a64(body) {
        return Err(bad("checksum mismatch (the data is corrupt or truncated)"));
    }
    let meta_len = r.len()?;
    let meta: Value =
        serde_json::from_slice(r.take(meta_len)?).map_err(|e| bad(format!("bad metadata ({e})")))?;
    let n_logits = r.len()?;
    let raw = r.take(n_logits.checked_mul(4).ok_or_else(|| bad("section too large"))?)?;
    let logits: Vec<f32> =
        raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let kv_len = r.len()?;
    let kv = r.take(kv_len)?.to_vec();
    if r.at != body.len() {
        return Err(bad("trailing bytes"));
    }
    Ok((meta, logits, kv))
}

/// The grammar of a saved branch state (`None` when it had none), replayed to where it was.
fn grammar_of(meta: &Value, model: &Arc<Model>) -> Result<Option<Grammar>> {
    Ok(match meta.get("grammar").filter(|g| !g.is_null()) {
        None => None,
        Some(g) => {
            let text = |k: &str| g.get(k).and_then(Value::as_str).map(str::to_string).ok_or_else(|| bad(k));
            // States saved before llguidance hold GBNF under "gbnf" and no "kind".
            let kind = match g.get("kind").and_then(Value::as_str) {
                None => GrammarKind::Gbnf,
                Some(name) => GrammarKind::parse(name).ok_or_else(|| bad("grammar kind"))?,
            };
            let text_key = if g.get("text").is_some() { "text" } else { "gbnf" };
            let engine = match g.get("engine").and_then(Value::as_str) {
                None => GbnfEngineChoice::Auto,
                Some(name) => GbnfEngineChoice::parse(name).ok_or_else(|| bad("grammar engine"))?,
            };
            let source = GrammarSource { kind, text: text(text_key)?, root: text("root")?, engine };
            let accepted = tokens_of(g, "accepted")?;
            Some(Grammar::restore(model.clone(), &source, &accepted).map_err(bad)?)
        }
    })
}

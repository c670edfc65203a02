//! Tokenizers built from GGUF metadata, matching llama.cpp token for token.
//!
//! For a GGUF file llama.cpp is the authority on tokenization, so this module follows its
//! `llama-vocab.cpp` rather than Hugging Face's GGUF loader (which ignores some pre-tokenizer
//! names and so splits text differently):
//!
//! * `tokenizer.ggml.model = "gpt2"`: byte-level BPE on the `tokenizers` crate, with the
//!   pre-tokenizer regexes named by `tokenizer.ggml.pre` (see [`pre`]) and the file's merges;
//! * `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE over `tokens` + `scores` with
//!   `<0xNN>` byte fallback, a port of llama.cpp's algorithm (`spm.rs`);
//! * control, user-defined and unknown tokens are found in the input text first (longest
//!   first, as llama.cpp's `tokenizer_st_partition` with `parse_special = true`), so
//!   `<|im_start|>` in a chat prompt is one id; the text between them is tokenized piece by
//!   piece;
//! * BOS/EOS are added only when the file says so (`add_bos_token`/`add_eos_token`, else
//!   llama.cpp's default for the vocabulary type);
//! * end-of-generation ids are llama.cpp's set: EOS, EOT, EOM, the FIM pad/repo/sep tokens and
//!   tokens whose text is a known end marker (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...).
//!
//! Decoding follows llama.cpp's `token_to_piece`. Not reproduced: `clean_spaces` (the
//! "clean up tokenization spaces" pass of `llama_detokenize`, which only some callers use) and
//! vocabulary types other than the two above (WordPiece, Unigram, RWKV, ...).
//!
//! The tests check ids against llama.cpp itself (tests/data/smollm2/, made by
//! scripts/reference/): SmolLM2's vocabulary, 21 pre-tokenizer families on random hard strings,
//! and a trained SentencePiece vocabulary.
//!
//! ```no_run
//! use anygpu_models::gguf::GgufFile;
//! use anygpu_models::tokenizer::LlmTokenizer;
//! let file = GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tok = LlmTokenizer::from_gguf(&file)?;
//! let ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n", true)?; // <|im_start|> is one id
//! let mut out = tok.stream_decoder(); // whole UTF-8 characters only
//! for &id in &ids {
//!     print!("{}", out.push(id));
//!     if tok.is_eog(id) {
//!         break;
//!     }
//! }
//! # Ok::<(), anygpu_core::Error>(())
//! ```

mod bpe;
pub mod pre;
pub mod spec;
mod spm;
mod stream;

use std::collections::{BTreeSet, HashMap};

use anygpu_core::{Error, Result};

pub use pre::PreTokenizer;
pub use spec::{token_type, TokenizerSpec};
pub use stream::StreamDecoder;

/// Another name for the spec, after what it holds.
pub type GgufVocab = TokenizerSpec;

// Token attributes, as llama.cpp's `llama_token_attr` bit flags.
const ATTR_UNKNOWN: u32 = 1 << 0;
const ATTR_UNUSED: u32 = 1 << 1;
const ATTR_NORMAL: u32 = 1 << 2;
const ATTR_CONTROL: u32 = 1 << 3;
const ATTR_USER_DEFINED: u32 = 1 << 4;
const ATTR_BYTE: u32 = 1 << 5;
const ATTR_LSTRIP: u32 = 1 << 7;
const ATTR_RSTRIP: u32 = 1 << 8;

/// Token texts llama.cpp takes as the end-of-turn token when the file names none.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
/// Token texts llama.cpp always counts as end of generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Which algorithm turns a text fragment into ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// `tokenizer.ggml.model = "llama"`: SentencePiece BPE with byte fallback.
    Spm,
    /// `tokenizer.ggml.model = "gpt2"`: byte-level BPE.
    Bpe,
}

enum Engine {
    Spm,
    Bpe(Box<tokenizers::Tokenizer>),
}

/// A piece of input text after special tokens were cut out of it.
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

/// The tokenizer of a GGUF language model. Cheap to share (`Send + Sync`).
pub struct LlmTokenizer {
    kind: VocabKind,
    engine: Engine,
    pre_name: Option<String>,
    tokens: Vec<String>,
    token_to_id: HashMap<String, u32>,
    scores: Vec<f32>,
    attrs: Vec<u32>,
    /// `token_to_piece(id, special = true)` for every id.
    pieces: Vec<Vec<u8>>,
    /// Ids matched in raw text before tokenization, longest text first.
    special_cache: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    sep: Option<u32>,
    eog: BTreeSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl std::fmt::Debug for LlmTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmTokenizer")
            .field("kind", &self.kind)
            .field("pre", &self.pre_name)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}

/// Builds the tokenizer described by a spec. Errors (`Error::Format`) name the offending key.
pub fn build(spec: &TokenizerSpec) -> Result<LlmTokenizer> {
    LlmTokenizer::from_spec(spec)
}

fn fmt_err(msg: impl Into<String>) -> Error {
    Error::Format(msg.into())
}

impl LlmTokenizer {
    /// The tokenizer of a GGUF file (`TokenizerSpec::from_gguf` then [`build`]).
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<LlmTokenizer> {
        LlmTokenizer::from_spec(&TokenizerSpec::from_gguf(file)?)
    }

    /// Same as [`build`].
    pub fn from_spec(spec: &TokenizerSpec) -> Result<LlmTokenizer> {
        let kind = match spec.model.as_str() {
            "llama" => VocabKind::Spm,
            "gpt2" => VocabKind::Bpe,
            other => {
                return Err(fmt_err(format!(
                    "tokenizer.ggml.model = {other:?} is not supported (supported: \"gpt2\" \
                     byte-level BPE, \"llama\" SentencePiece BPE)"
                )))
            }
        };
        let n = spec.tokens.len();
        if n == 0 {
            return Err(fmt_err("tokenizer.ggml.tokens is empty"));
        }
        if n > u32::MAX as usize {
            return Err(fmt_err("tokenizer.ggml.tokens has more than 2^32 entries"));
        }
        if let Some(s) = &spec.scores {
            if s.len() < n {
                return Err(fmt_err(format!("tokenizer.ggml.scores has {} entries for {n} tokens", s.len())));
            }
        }
        if let Some(t) = &spec.token_types {
            if t.len() < n {
                return Err(fmt_err(format!("tokenizer.ggml.token_type has {} entries for {n} tokens", t.len())));
            }
        }

        let mut tokens = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in spec.tokens.iter().enumerate() {
            let text = if t.is_empty() { format!("[EMPTY_{i}]") } else { t.clone() };
            token_to_id.insert(text.clone(), i as u32);
            tokens.push(text);
        }
        let scores = match &spec.scores {
            Some(s) => s[..n].to_vec(),
            None => vec![0.0; n],
        };
        let mut attrs: Vec<u32> = (0..n)
            .map(|i| match spec.token_types.as_ref().map(|t| t[i]) {
                None | Some(token_type::NORMAL) => ATTR_NORMAL,
                Some(token_type::UNKNOWN) => ATTR_UNKNOWN,
                Some(token_type::CONTROL) => ATTR_CONTROL,
                Some(token_type::USER_DEFINED) => ATTR_USER_DEFINED,
                Some(token_type::UNUSED) => ATTR_UNUSED,
                Some(token_type::BYTE) => ATTR_BYTE,
                Some(_) => 0,
            })
            .collect();

        // Per-type defaults, then the file's values (llama.cpp `load`).
        let pre = match kind {
            VocabKind::Bpe => {
                let name = spec.pre.as_deref().filter(|s| !s.is_empty());
                if name.is_none() {
                    log::warn!(
                        "tokenizer.ggml.pre is missing: using llama.cpp's 'default' \
                         pre-tokenizer; generation quality may be degraded"
                    );
                }
                Some(PreTokenizer::from_name(name).ok_or_else(|| {
                    fmt_err(format!(
                        "tokenizer.ggml.pre = {:?} is not a pre-tokenizer anygpu knows; known: {}",
                        name.unwrap_or_default(),
                        pre::KNOWN_NAMES.join(", ")
                    ))
                })?)
            }
            VocabKind::Spm => None,
        };
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        let pick = |key: &str, file: Option<u32>, default: Option<u32>| -> Option<u32> {
            match file {
                Some(id) if (id as usize) < n => Some(id),
                Some(id) => {
                    log::warn!("tokenizer.ggml.{key} = {id} is outside the vocabulary ({n} tokens)");
                    in_range(default)
                }
                None => in_range(default),
            }
        };
        let (def_bos, def_eos, def_unk) = match kind {
            VocabKind::Spm => (Some(1), Some(2), Some(0)),
            VocabKind::Bpe => (Some(11), Some(11), None),
        };
        let def_bos = if pre.as_ref().is_some_and(|p| p.no_bos) { None } else { def_bos };
        let bos = pick("bos_token_id", spec.bos_token_id, def_bos);
        let eos = pick("eos_token_id", spec.eos_token_id, def_eos);
        let unk = pick("unknown_token_id", spec.unknown_token_id, def_unk);
        let pad = pick("padding_token_id", spec.padding_token_id, None);
        let sep = pick("seperator_token_id", spec.separator_token_id, None);
        let mut eot = pick("eot_token_id", spec.eot_token_id, None);
        let mut eom = pick("eom_token_id", spec.eom_token_id, None);
        let mut fim_pad = pick("fim_pad_token_id", spec.fim_pad_token_id, None);
        let mut fim_rep = pick("fim_rep_token_id", spec.fim_rep_token_id, None);
        let mut fim_sep = pick("fim_sep_token_id", spec.fim_sep_token_id, None);

        let (default_add_bos, add_space_prefix_default) = match kind {
            VocabKind::Spm => (true, true),
            VocabKind::Bpe => (pre.as_ref().and_then(|p| p.default_add_bos).unwrap_or(false), false),
        };
        let add_bos = spec.add_bos_token.unwrap_or(default_add_bos);
        let add_eos = spec.add_eos_token.unwrap_or(false);
        let add_space_prefix = spec.add_space_prefix.unwrap_or(add_space_prefix_default);

        // Special tokens recognised by their text; each found one becomes a control token.
        // Ids are visited in ascending order over distinct texts (llama.cpp walks a hash map).
        let unique: Vec<u32> = (0..n as u32).filter(|&i| token_to_id.get(&tokens[i as usize]) == Some(&i)).collect();
        let find = |texts: &[&str]| unique.iter().copied().find(|&i| texts.contains(&tokens[i as usize].as_str()));
        let make_control = |id: u32, attrs: &mut Vec<u32>| attrs[id as usize] |= ATTR_CONTROL;
        if eot.is_none() {
            eot = find(EOT_TEXTS);
            if let Some(id) = eot {
                make_control(id, &mut attrs);
            }
        }
        if eom.is_none() {
            eom = find(&["<|eom_id|>"]);
            if let Some(id) = eom {
                make_control(id, &mut attrs);
            }
        }
        for texts in [FIM_PRE_TEXTS, FIM_SUF_TEXTS, FIM_MID_TEXTS] {
            if let Some(id) = find(texts) {
                make_control(id, &mut attrs);
            }
        }
        for (slot, texts) in
            [(&mut fim_pad, FIM_PAD_TEXTS), (&mut fim_rep, FIM_REP_TEXTS), (&mut fim_sep, FIM_SEP_TEXTS)]
        {
            if slot.is_none() {
                *slot = find(texts);
                if let Some(id) = *slot {
                    make_control(id, &mut attrs);
                }
            }
        }

        let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for &i in &unique {
            if EOG_TEXTS.contains(&tokens[i as usize].as_str()) {
                eog.insert(i);
                make_control(i, &mut attrs);
            }
        }
        // gpt-oss: these are always rendered.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_to_id.get(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        {
            let has = |t: &str| eog.iter().any(|&i| tokens[i as usize] == t);
            let has_call = has("<|call|>") || has("<|calls|>");
            let drop_end = has_call && (has("<|return|>") || has("<|flush|>"));
            let normal_s = has("<|tool_response>") || has("<|plamo:eos|>");
            let end = eog.iter().copied().find(|&i| tokens[i as usize] == "<|end|>");
            let s_id = eog.iter().copied().find(|&i| tokens[i as usize] == "</s>");
            if let (Some(end), true) = (end, drop_end) {
                eog.remove(&end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
            if let (Some(s), true) = (s_id, normal_s) {
                eog.remove(&s);
                attrs[s as usize] = ATTR_NORMAL;
            }
        }

        let mut special_cache: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        special_cache.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));

        // Strip flags llama.cpp sets by model or pre-tokenizer name.
        let model_name = spec.model_name.as_deref().unwrap_or_default().to_lowercase();
        let pre_name = spec.pre.as_deref().unwrap_or_default();
        let set_attr = |attrs: &mut Vec<u32>, text: &str, flag: u32, on: bool| {
            if let Some(&id) = token_to_id.get(text) {
                if on {
                    attrs[id as usize] |= flag;
                } else {
                    attrs[id as usize] &= !flag;
                }
            }
        };
        if ["jina-v2-de", "jina-v2-es", "jina-v2-code"].iter().any(|p| pre_name.contains(p)) {
            set_attr(&mut attrs, "<mask>", ATTR_LSTRIP, true);
        } else if model_name.contains("phi-3") || model_name.contains("phi3") {
            for &id in &special_cache {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            set_attr(&mut attrs, "</s>", ATTR_RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set_attr(&mut attrs, t, ATTR_RSTRIP, false);
            }
        } else if model_name.contains("modern-bert") {
            set_attr(&mut attrs, "[MASK]", ATTR_LSTRIP, true);
        }

        // Pieces (token_to_piece with special = true).
        let char_to_byte = bpe::char_to_byte_map();
        let pieces: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let (text, attr) = (&tokens[i], attrs[i]);
                if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
                    text.as_bytes().to_vec()
                } else if attr & ATTR_NORMAL != 0 {
                    match kind {
                        VocabKind::Spm => text.replace('\u{2581}', " ").into_bytes(),
                        VocabKind::Bpe => bpe::decode_byte_level(text, &char_to_byte),
                    }
                } else if attr & ATTR_BYTE != 0 {
                    parse_byte_token(text).map(|b| vec![b]).unwrap_or_default()
                } else {
                    Vec::new()
                }
            })
            .collect();

        let engine = match kind {
            VocabKind::Spm => Engine::Spm,
            VocabKind::Bpe => {
                let merges = spec
                    .merges
                    .as_deref()
                    .ok_or_else(|| fmt_err("tokenizer.ggml.merges is missing (required for a \"gpt2\" vocabulary)"))?;
                let pre = pre.as_ref().ok_or_else(|| fmt_err("internal: no pre-tokenizer"))?;
                Engine::Bpe(Box::new(bpe::build_bpe(&token_to_id, merges, pre)?))
            }
        };

        Ok(LlmTokenizer {
            kind,
            engine,
            pre_name: spec.pre.clone(),
            tokens,
            token_to_id,
            scores,
            attrs,
            pieces,
            special_cache,
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            sep,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// Tokenizes `text`, recognising special tokens in it (llama.cpp `parse_special = true`).
    /// `add_special` adds BOS/EOS where the model asks for them.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Tokenizes `text`. With `parse_special = false`, control tokens in the text are plain
    /// text (user-defined tokens are still matched, as llama.cpp and Hugging Face do).
    pub fn encode_with(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(
                self.bos
                    .ok_or_else(|| fmt_err("the model asks for a BOS token (add_bos_token) but has no bos_token_id"))?,
            );
        }
        let mut prev_special = true;
        for frag in &fragments {
            match *frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(start, end) => {
                    let piece = &text[start..end];
                    match &self.engine {
                        Engine::Spm => {
                            let mut s = String::with_capacity(piece.len() * 3 / 2 + 3);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(piece);
                            let escaped = s.replace(' ', "\u{2581}");
                            spm::tokenize(self, &escaped, &mut out)?;
                        }
                        Engine::Bpe(tk) => {
                            let enc = tk
                                .encode_fast(piece, false)
                                .map_err(|e| fmt_err(format!("tokenizer: encoding {piece:?} failed: {e}")))?;
                            out.extend_from_slice(enc.get_ids());
                        }
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.push(
                self.eos.ok_or_else(|| {
                    fmt_err("the model asks for an EOS token (add_eos_token) but has no eos_token_id")
                })?,
            );
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`: cut special tokens out of the text, longest token
    /// text first, each one everywhere it occurs in what is left.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut buf = Vec::new();
        if text.is_empty() {
            return buf;
        }
        buf.push(Fragment::Text(0, text.len()));
        for &id in &self.special_cache {
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            if !buf.iter().any(|f| matches!(*f, Fragment::Text(s, e) if text[s..e].contains(pat))) {
                continue;
            }
            let mut next = Vec::with_capacity(buf.len() + 2);
            for frag in buf {
                let (mut start, end) = match frag {
                    Fragment::Text(s, e) => (s, e),
                    tok => {
                        next.push(tok);
                        continue;
                    }
                };
                while start < end {
                    let Some(rel) = text[start..end].find(pat) else {
                        next.push(Fragment::Text(start, end));
                        break;
                    };
                    let m = start + rel;
                    let mut left_end = m;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > start && is_c_space(text.as_bytes()[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Fragment::Text(start, left_end));
                    }
                    next.push(Fragment::Token(id));
                    start = m + pat.len();
                    if attr & ATTR_RSTRIP != 0 {
                        while start < end && is_c_space(text.as_bytes()[start]) {
                            start += 1;
                        }
                    }
                }
            }
            buf = next;
        }
        buf
    }

    /// Text of the ids, special tokens included (llama.cpp `detokenize` with
    /// `unparse_special = true`): `decode(encode(s)) == s` for the texts llama.cpp round-trips.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, true)
    }

    /// Text of the ids; with `special = false` control and unknown tokens give no text.
    /// Like llama.cpp, one leading space is removed from the first token where the model adds a
    /// space prefix (SentencePiece), and ids outside the vocabulary give nothing.
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let p = self.piece(id, special);
            if i == 0 && self.add_space_prefix && p.first() == Some(&b' ') {
                bytes.extend_from_slice(&p[1..]);
            } else {
                bytes.extend_from_slice(p);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes one token stands for (may be part of a UTF-8 character).
    pub fn piece(&self, id: u32, special: bool) -> &[u8] {
        let i = id as usize;
        match (self.pieces.get(i), self.attrs.get(i)) {
            (Some(_), Some(&a)) if !special && a & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 => &[],
            (Some(p), _) => p,
            _ => &[],
        }
    }

    /// A streaming decoder over this tokenizer.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// The token's text as stored in the vocabulary (`Ġ`/`▁` markers and all).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a vocabulary entry, by its stored text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn kind(&self) -> VocabKind {
        self.kind
    }

    /// The `tokenizer.ggml.pre` value in use (None for SentencePiece or a file without one).
    pub fn pre_name(&self) -> Option<&str> {
        self.pre_name.as_deref()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    /// End of turn (`<|im_end|>`, `<|eot_id|>`, ...), from the file or found by its text.
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }
    /// End of message (`<|eom_id|>`).
    pub fn eom_id(&self) -> Option<u32> {
        self.eom
    }
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }
    pub fn sep_id(&self) -> Option<u32> {
        self.sep
    }
    /// Whether `encode(.., add_special = true)` puts BOS first / EOS last.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Every id that ends generation, ascending.
    pub fn eog_ids(&self) -> Vec<u32> {
        self.eog.iter().copied().collect()
    }

    /// Whether generation stops at this id (llama.cpp `llama_vocab_is_eog`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// A control token (BOS, `<|im_start|>`, ...): rendered only on request.
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & ATTR_CONTROL != 0)
    }

    /// Matched as one token in input text (control, user-defined or unknown).
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
    }
}

impl spm::SpmVocab for LlmTokenizer {
    fn id_of(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
    fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }
    fn byte_token(&self, byte: u8) -> Option<u32> {
        let hex = format!("<0x{byte:02X}>");
        self.token_to_id
            .get(&hex)
            .copied()
            .or_else(|| std::str::from_utf8(&[byte]).ok().and_then(|s| self.token_to_id.get(s).copied()))
    }
    fn unk(&self) -> Option<u32> {
        self.unk
    }
}

/// `<0xNN>` → NN.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// C's `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

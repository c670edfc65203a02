//! Byte-level BPE ("gpt2" vocabularies) on the Hugging Face `tokenizers` crate: the
//! pre-tokenizer regexes of [`super::pre`], GPT-2's byte-to-character mapping, and the merges
//! from `tokenizer.ggml.merges`.

use std::collections::{HashMap, HashSet};

use anygpu_core::{Error, Result};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{SplitDelimiterBehavior, Tokenizer};

use super::pre::PreTokenizer;

/// GPT-2's reversible map from bytes to printable characters (`bytes_to_unicode`).
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\u{FFFD}');
            n += 1;
            c
        };
    }
    table
}

/// The inverse of [`byte_to_char_table`].
pub(crate) fn char_to_byte_map() -> HashMap<char, u8> {
    byte_to_char_table().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect()
}

/// Decodes a byte-level token's text to its bytes, as llama.cpp's `llama_decode_text`; a
/// character outside the 256-entry alphabet is kept as its UTF-8 bytes.
pub(crate) fn decode_byte_level(text: &str, map: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Builds the `tokenizers` pipeline for one text fragment: pre-tokenizer splits, the byte-level
/// alphabet, BPE. Special tokens are matched before this runs, so it has none of its own.
///
/// `vocab` maps token text to id (llama.cpp's `token_to_id`: for duplicated texts the last id
/// wins). Merges are "left right" strings split at the first space after the first byte;
/// merges whose parts or result are not tokens, and repeated merges, are dropped (llama.cpp
/// keeps them but they can never produce a token).
pub(crate) fn build_bpe(vocab: &HashMap<String, u32>, merges: &[String], pre: &PreTokenizer) -> Result<Tokenizer> {
    let mut pairs = Vec::with_capacity(merges.len());
    let mut seen = HashSet::with_capacity(merges.len());
    let mut dropped = 0usize;
    for m in merges {
        // The first space after the first byte (a space cannot sit inside a UTF-8 sequence).
        let split = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(pos) = split else {
            dropped += 1;
            continue;
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        let joined = format!("{a}{b}");
        if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&joined) {
            dropped += 1;
            continue;
        }
        if seen.insert((a.to_string(), b.to_string())) {
            pairs.push((a.to_string(), b.to_string()));
        }
    }
    if dropped > 0 {
        log::warn!(
            "tokenizer: {dropped} entries of tokenizer.ggml.merges are malformed or name \
             tokens outside the vocabulary; ignored"
        );
    }

    let model = BPE::builder()
        .vocab_and_merges(vocab.iter().map(|(k, &v)| (k.clone(), v)).collect::<tokenizers::models::bpe::Vocab>(), pairs)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| Error::Format(format!("tokenizer.ggml.merges: building BPE failed: {e}")))?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for re in &pre.regexes {
        let split = Split::new(SplitPattern::Regex((*re).to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| {
                Error::Format(format!("tokenizer.ggml.pre ({}): regex {re:?} does not compile: {e}", pre.family))
            })?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());

    let mut tk = Tokenizer::new(model);
    tk.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tk)
}

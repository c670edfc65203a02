//! SentencePiece-style BPE ("llama" vocabularies), a port of llama.cpp's
//! `llm_tokenizer_spm_session`: start from UTF-8 characters, repeatedly merge the adjacent pair
//! whose concatenation is a vocabulary token with the highest score (leftmost on ties), then
//! spell every leftover symbol that is not a token as `<0xNN>` byte tokens.
//!
//! This is deliberately not Hugging Face's merges-derived BPE: llama.cpp breaks ties between
//! equal scores by position, which a merge list with distinct ranks cannot express.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use anygpu_core::{Error, Result};

struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap's top is the highest score, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.partial_cmp(&other.score).unwrap_or(Ordering::Equal).then_with(|| other.left.cmp(&self.left))
    }
}

/// What the SPM algorithm needs of the vocabulary.
pub(crate) trait SpmVocab {
    fn id_of(&self, text: &str) -> Option<u32>;
    fn score(&self, id: u32) -> f32;
    /// The token for one raw byte: `<0xNN>`, else the byte as a one-byte string.
    fn byte_token(&self, byte: u8) -> Option<u32>;
    fn unk(&self) -> Option<u32>;
}

/// Tokenizes one text fragment (spaces already escaped as U+2581) and appends the ids.
pub(crate) fn tokenize(vocab: &impl SpmVocab, text: &str, out: &mut Vec<u32>) -> Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    let n_chars = text.chars().count();
    for (i, (start, c)) in text.char_indices().enumerate() {
        symbols.push(Symbol {
            prev: i.checked_sub(1),
            next: if i + 1 < n_chars { Some(i + 1) } else { None },
            start,
            len: c.len_utf8(),
        });
    }

    let mut queue = BinaryHeap::new();
    let try_add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, l: Option<usize>, r: Option<usize>| {
        let (Some(left), Some(right)) = (l, r) else {
            return;
        };
        let size = symbols[left].len + symbols[right].len;
        let start = symbols[left].start;
        let piece = &text[start..start + size];
        if let Some(id) = vocab.id_of(piece) {
            queue.push(Bigram { left, right, score: vocab.score(id), size });
        }
    };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, Some(i - 1), Some(i));
    }

    while let Some(b) = queue.pop() {
        let (l, r) = (&symbols[b.left], &symbols[b.right]);
        // One side already merged elsewhere: a stale pair (llama.cpp checks sizes only).
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        let right_next = symbols[b.right].next;
        symbols[b.left].len += symbols[b.right].len;
        symbols[b.right].len = 0;
        symbols[b.left].next = right_next;
        if let Some(n) = right_next {
            symbols[n].prev = Some(b.left);
        }
        let left_prev = symbols[b.left].prev;
        try_add(&symbols, &mut queue, left_prev, Some(b.left));
        try_add(&symbols, &mut queue, Some(b.left), right_next);
    }

    let mut i = Some(0);
    while let Some(idx) = i {
        let s = &symbols[idx];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id_of(piece) {
            Some(id) => out.push(id),
            None => {
                // A symbol that formed no token: llama.cpp's `resegment` spells it in bytes.
                for &byte in piece.as_bytes() {
                    match vocab.byte_token(byte).or_else(|| vocab.unk()) {
                        Some(id) => out.push(id),
                        None => {
                            return Err(Error::Format(format!(
                                "tokenizer: the vocabulary has no byte token <0x{byte:02X}> and \
                                 no unknown token (tokenizer.ggml.unknown_token_id) to spell \
                                 {piece:?}"
                            )))
                        }
                    }
                }
            }
        }
        i = s.next;
    }
    Ok(())
}

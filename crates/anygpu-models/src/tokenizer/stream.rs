//! Incremental detokenization for generation: ids in one at a time, only whole UTF-8 text out.

use super::LlmTokenizer;

/// Turns generated ids into text as they arrive. A character whose bytes are spread over
/// several tokens (byte-fallback `<0xNN>` tokens, or byte-level BPE pieces that end inside a
/// multi-byte character) is held back until it is complete, so what comes out is always valid
/// UTF-8 and never a broken character. Bytes that can never form a character (an invalid
/// sequence) come out as U+FFFD instead of stalling the stream.
///
/// Control tokens (`<|im_end|>`, ...) produce no text unless [`StreamDecoder::with_special`]
/// asks for them, as llama.cpp's `token_to_piece(special = false)`.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'a> {
    tok: &'a LlmTokenizer,
    pending: Vec<u8>,
    special: bool,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a LlmTokenizer) -> Self {
        StreamDecoder { tok, pending: Vec::new(), special: false }
    }

    /// Render control and unknown tokens as their text.
    pub fn with_special(mut self, special: bool) -> Self {
        self.special = special;
        self
    }

    /// Adds one token; returns the text that became complete (often empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending.extend_from_slice(self.tok.piece(id, self.special));
        self.take_complete()
    }

    /// Adds several tokens; returns the text that became complete.
    pub fn push_all(&mut self, ids: &[u32]) -> String {
        for &id in ids {
            self.pending.extend_from_slice(self.tok.piece(id, self.special));
        }
        self.take_complete()
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is held back comes out, an unfinished character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            start = valid;
                            break;
                        }
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start = valid + n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

//! The tokenizer part of a GGUF file's metadata, as plain data.

use anygpu_core::{Error, Result};

use crate::gguf::{Array, GgufFile, Value};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Everything the tokenizer needs from a GGUF file's `tokenizer.ggml.*` (and two `general.*`)
/// keys. Optional keys are `None` when the file lacks them; `build` then applies llama.cpp's
/// defaults for the vocabulary type.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a BPE vocabulary.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` (see [`token_type`]).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: "left right" pairs, highest priority first.
    pub merges: Option<Vec<String>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub separator_token_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` / `eom_token_id`: end of turn / end of message.
    pub eot_token_id: Option<u32>,
    pub eom_token_id: Option<u32>,
    /// `tokenizer.ggml.fim_{pad,rep,sep}_token_id`: llama.cpp counts them as end of generation.
    pub fim_pad_token_id: Option<u32>,
    pub fim_rep_token_id: Option<u32>,
    pub fim_sep_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `general.name`: llama.cpp sets per-token strip flags by model name (Phi-3).
    pub model_name: Option<String>,
}

impl TokenizerSpec {
    /// Reads the tokenizer keys of an open GGUF file. Absent optional keys stay `None`; a
    /// missing `tokenizer.ggml.model` or `tokenizer.ggml.tokens`, or any key of the wrong type,
    /// is an `Error::Format` naming the key.
    pub fn from_gguf(file: &GgufFile) -> Result<TokenizerSpec> {
        let opt_u32 = |key: &str| -> Result<Option<u32>> {
            Ok(match file.get(key) {
                Some(_) => Some(file.get_u32(key)?),
                None => None,
            })
        };
        let opt_bool = |key: &str| -> Result<Option<bool>> {
            Ok(match file.get(key) {
                Some(_) => Some(file.get_bool(key)?),
                None => None,
            })
        };
        let opt_str = |key: &str| -> Result<Option<String>> {
            Ok(match file.get(key) {
                Some(_) => Some(file.get_str(key)?.to_string()),
                None => None,
            })
        };
        let model = match file.get("tokenizer.ggml.model") {
            Some(_) => file.get_str("tokenizer.ggml.model")?.to_string(),
            None => {
                return Err(Error::Format(
                    "GGUF metadata 'tokenizer.ggml.model' is missing: the file has no tokenizer".into(),
                ))
            }
        };
        let tokens = file.get_string_array("tokenizer.ggml.tokens")?.to_vec();
        // llama.cpp accepts f32 or i32 scores, and i32 token types.
        let scores = match file.get("tokenizer.ggml.scores") {
            None => None,
            Some(Value::Array(Array::F32(a))) => Some(a.clone()),
            Some(Value::Array(Array::I32(a))) => Some(a.iter().map(|&x| x as f32).collect()),
            Some(v) => {
                return Err(Error::Format(format!(
                    "GGUF metadata 'tokenizer.ggml.scores': expected array of f32 or i32, found {}",
                    v.type_name()
                )))
            }
        };
        let token_types = match file.get("tokenizer.ggml.token_type") {
            None => None,
            Some(_) => Some(file.get_i32_array("tokenizer.ggml.token_type")?.to_vec()),
        };
        let merges = match file.get("tokenizer.ggml.merges") {
            None => None,
            Some(_) => Some(file.get_string_array("tokenizer.ggml.merges")?.to_vec()),
        };
        Ok(TokenizerSpec {
            model,
            pre: opt_str("tokenizer.ggml.pre")?,
            tokens,
            scores,
            token_types,
            merges,
            bos_token_id: opt_u32("tokenizer.ggml.bos_token_id")?,
            eos_token_id: opt_u32("tokenizer.ggml.eos_token_id")?,
            unknown_token_id: opt_u32("tokenizer.ggml.unknown_token_id")?,
            padding_token_id: opt_u32("tokenizer.ggml.padding_token_id")?,
            // llama.cpp's key name is spelled this way.
            separator_token_id: opt_u32("tokenizer.ggml.seperator_token_id")?,
            eot_token_id: opt_u32("tokenizer.ggml.eot_token_id")?,
            eom_token_id: opt_u32("tokenizer.ggml.eom_token_id")?,
            fim_pad_token_id: opt_u32("tokenizer.ggml.fim_pad_token_id")?,
            fim_rep_token_id: opt_u32("tokenizer.ggml.fim_rep_token_id")?,
            fim_sep_token_id: opt_u32("tokenizer.ggml.fim_sep_token_id")?,
            add_bos_token: opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos_token: opt_bool("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: opt_bool("tokenizer.ggml.add_space_prefix")?,
            model_name: opt_str("general.name")?,
        })
    }
}

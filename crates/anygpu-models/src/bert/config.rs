//! What a Hugging Face BERT folder says about the model (`config.json`) and, for a
//! sentence-transformers folder, about the embedding (`modules.json`, `1_Pooling/config.json`,
//! `sentence_bert_config.json`).

use std::path::Path;

use anygpu_core::{Error, Result};
use serde::Deserialize;

/// `config.json` of a `BertModel` (the fields the forward pass uses).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_pos_type")]
    pub position_embedding_type: String,
    #[serde(default)]
    pub model_type: Option<String>,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_max_pos() -> usize {
    512
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_pos_type() -> String {
    "absolute".into()
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| Error::Format(format!("{}: {e}", path.display())))
}

impl BertConfig {
    pub fn from_file(path: &Path) -> Result<BertConfig> {
        let c: BertConfig = read_json(path)?;
        c.validate().map_err(|msg| Error::Format(format!("{}: {msg}", path.display())))?;
        Ok(c)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if let Some(t) = &self.model_type {
            // RoBERTa-style models offset their positions by the padding index: not this forward.
            if t != "bert" {
                return Err(format!("model_type '{t}' is not supported (bert)"));
            }
        }
        if self.num_attention_heads == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            if v == 0 || v > 1 << 24 {
                return Err(format!("{name} = {v} is out of range"));
            }
        }
        if self.num_hidden_layers > 1024 {
            return Err(format!("num_hidden_layers = {} is out of range", self.num_hidden_layers));
        }
        if !matches!(self.hidden_act.as_str(), "gelu" | "gelu_new" | "gelu_pytorch_tanh" | "relu") {
            return Err(format!("hidden_act '{}' is not supported (gelu, gelu_new, relu)", self.hidden_act));
        }
        if self.position_embedding_type != "absolute" {
            return Err(format!(
                "position_embedding_type '{}' is not supported (absolute only)",
                self.position_embedding_type
            ));
        }
        if !(self.layer_norm_eps > 0.0 && self.layer_norm_eps < 1.0) {
            return Err(format!("layer_norm_eps = {} is out of range", self.layer_norm_eps));
        }
        Ok(())
    }
}

/// How token vectors become one sentence vector. Several may be on at once: the results are
/// concatenated in sentence-transformers' order (CLS, max, mean, mean / sqrt(len)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pooling {
    pub cls: bool,
    pub max: bool,
    pub mean: bool,
    pub mean_sqrt_len: bool,
}

impl Pooling {
    pub const MEAN: Pooling = Pooling { cls: false, max: false, mean: true, mean_sqrt_len: false };
    pub const CLS: Pooling = Pooling { cls: true, max: false, mean: false, mean_sqrt_len: false };
    pub const MAX: Pooling = Pooling { cls: false, max: true, mean: false, mean_sqrt_len: false };

    /// `--pooling mean|cls|max`.
    pub fn parse(s: &str) -> Option<Pooling> {
        match s {
            "mean" => Some(Pooling::MEAN),
            "cls" => Some(Pooling::CLS),
            "max" => Some(Pooling::MAX),
            _ => None,
        }
    }

    /// How many hidden-size blocks the pooled vector has.
    pub fn n_modes(&self) -> usize {
        [self.cls, self.max, self.mean, self.mean_sqrt_len].iter().filter(|&&b| b).count()
    }

    pub fn name(&self) -> String {
        let mut v = Vec::new();
        for (on, n) in
            [(self.cls, "cls"), (self.max, "max"), (self.mean, "mean"), (self.mean_sqrt_len, "mean_sqrt_len")]
        {
            if on {
                v.push(n);
            }
        }
        v.join("+")
    }
}

#[derive(Deserialize)]
struct PoolingFile {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
    #[serde(default)]
    include_prompt: Option<bool>,
}

#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct SentenceBertFile {
    max_seq_length: Option<usize>,
    #[serde(default)]
    do_lower_case: bool,
}

/// The sentence-transformers pipeline of a folder: pooling, normalisation, max_seq_length.
#[derive(Clone, Debug, PartialEq)]
pub struct SentenceConfig {
    pub pooling: Pooling,
    /// An L2 normalisation module follows the pooling.
    pub normalize: bool,
    /// Inputs are truncated to this many tokens, [CLS] and [SEP] included (None: the model's
    /// position count; see [`SentenceConfig::max_len`]).
    pub max_seq_length: Option<usize>,
    /// Lower-case the text before tokenizing (sentence_bert_config.json's `do_lower_case`).
    pub do_lower_case: bool,
    /// The Transformer module's folder (config.json, model.safetensors, tokenizer.json),
    /// relative to the sentence-transformers folder; empty for the folder itself.
    pub transformer_path: String,
}

impl SentenceConfig {
    /// Reads `modules.json` (when present) and the files it points to. A plain BERT folder
    /// (no modules.json) gets mean pooling, no normalisation, max_seq_length =
    /// max_position_embeddings: what sentence-transformers does with a bare transformer.
    pub fn from_dir(dir: &Path) -> Result<SentenceConfig> {
        let fmt = |p: &Path, msg: String| Error::Format(format!("{}: {msg}", p.display()));
        let mut cfg = SentenceConfig {
            pooling: Pooling::MEAN,
            normalize: false,
            max_seq_length: None,
            do_lower_case: false,
            transformer_path: String::new(),
        };
        let mut st: Option<SentenceBertFile> = None;
        let modules_path = dir.join("modules.json");
        if modules_path.exists() {
            let modules: Vec<Module> = read_json(&modules_path)?;
            for m in &modules {
                match m.kind.rsplit('.').next().unwrap_or("") {
                    "Transformer" => {
                        cfg.transformer_path = m.path.clone();
                        let p = dir.join(&m.path).join("sentence_bert_config.json");
                        if p.exists() {
                            st = Some(read_json(&p)?);
                        }
                    }
                    "Pooling" => {
                        let p = dir.join(&m.path).join("config.json");
                        let f: PoolingFile = read_json(&p)?;
                        if f.pooling_mode_weightedmean_tokens || f.pooling_mode_lasttoken {
                            return Err(fmt(&p, "weighted-mean and last-token pooling are not supported".into()));
                        }
                        if f.include_prompt == Some(false) {
                            return Err(fmt(&p, "include_prompt = false is not supported".into()));
                        }
                        cfg.pooling = Pooling {
                            cls: f.pooling_mode_cls_token,
                            max: f.pooling_mode_max_tokens,
                            mean: f.pooling_mode_mean_tokens,
                            mean_sqrt_len: f.pooling_mode_mean_sqrt_len_tokens,
                        };
                        if cfg.pooling.n_modes() == 0 {
                            return Err(fmt(&p, "no pooling mode is enabled".into()));
                        }
                    }
                    "Normalize" => cfg.normalize = true,
                    _ => {
                        return Err(fmt(
                            &modules_path,
                            format!("module '{}' is not supported (Transformer, Pooling and Normalize are)", m.kind),
                        ))
                    }
                }
            }
        }
        if st.is_none() {
            let p = dir.join("sentence_bert_config.json");
            if p.exists() {
                st = Some(read_json(&p)?);
            }
        }
        cfg.max_seq_length = st.as_ref().and_then(|s| s.max_seq_length);
        cfg.do_lower_case = st.as_ref().is_some_and(|s| s.do_lower_case);
        Ok(cfg)
    }

    /// The truncation length: max_seq_length, capped (as sentence-transformers does) at what
    /// the position table holds.
    pub fn max_len(&self, bert: &BertConfig) -> Result<usize> {
        let n = self.max_seq_length.unwrap_or(bert.max_position_embeddings).min(bert.max_position_embeddings);
        if n < 2 {
            return Err(Error::Format(format!("max_seq_length {n} leaves no room for [CLS] and [SEP]")));
        }
        Ok(n)
    }
}

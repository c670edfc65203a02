//! Pre-tokenizers of byte-level BPE vocabularies, by the name in `tokenizer.ggml.pre`.
//!
//! The regex lists and flags are llama.cpp's (`llama-vocab.cpp`, `llm_tokenizer_bpe` and
//! `llama_vocab::impl::load`): each regex splits every piece left by the previous one, and both
//! the matches and the text between them become pieces (Hugging Face's `Split` with the
//! `Isolated` behaviour). llama.cpp runs some of these through hand-written matchers and the
//! rest through `std::regex` on a "collapsed" text; we run them all through Oniguruma, which
//! agrees with both on the Unicode classes these patterns use.
//!
//! Names llama.cpp knows but that we do not reproduce (Kimi-K2's `\p{Han}` splitter, SuperBPE's
//! zero-width splits, Gemma 4's SPM-style BPE, ...) give an error naming the value rather than
//! a silently different tokenization.
//!
//! One quirk is reproduced on purpose: llama.cpp matches regexes without `\p{..}` classes on a
//! copy of the text where every non-ASCII whitespace character is replaced by U+000B, so such a
//! character never matches an explicit non-ASCII range (DeepSeek's `[ࠀ-一]` spans U+3000).
//! Those classes carry `&&[^\s]` here.

/// How a BPE vocabulary splits text before the merges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreTokenizer {
    /// llama.cpp's pre-tokenizer family (`LLAMA_VOCAB_PRE_TYPE_*`, lower-case), for messages.
    pub family: &'static str,
    /// Regexes applied in order.
    pub regexes: Vec<&'static str>,
    /// Take a whole pre-tokenized word as one token when the vocabulary has it (Llama 3 style).
    pub ignore_merges: bool,
    /// Default for `add_bos` when the file does not say (llama.cpp sets it for some families).
    pub default_add_bos: Option<bool>,
    /// The family drops the BOS id altogether (ChatGLM).
    pub no_bos: bool,
}

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
const DEEPSEEK_LLM: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}&&[^\\s]]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。&&[^\\s]]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿&&[^\\s]]+",
    "\\p{N}+",
];
const DEEPSEEK_CODER: [&str; 5] = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿&&[^\\s]]+", r"\p{N}"];
const DEEPSEEK3: [&str; 3] = [
    r"\p{N}{1,3}",
    "[一-龥\u{3040}-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const UFAKZEKA: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const MINICPM5: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";

/// Every name accepted in `tokenizer.ggml.pre`, for error messages and docs.
pub const KNOWN_NAMES: &[&str] = &[
    "default",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "dbrx",
    "smaug-bpe",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "falcon",
    "mpt",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "gpt2",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "exaone4",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "jais-2",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
    "qwen35",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "viking",
    "tekken",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "seed-coder",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "grok-2",
    "ufakzeka",
    "minicpm5",
    "exaone-moe",
    "laguna",
];

impl PreTokenizer {
    fn new(family: &'static str, regexes: &[&'static str]) -> Self {
        PreTokenizer { family, regexes: regexes.to_vec(), ignore_merges: false, default_add_bos: None, no_bos: false }
    }

    fn ignore_merges(mut self) -> Self {
        self.ignore_merges = true;
        self
    }

    fn add_bos(mut self) -> Self {
        self.default_add_bos = Some(true);
        self
    }

    /// The pre-tokenizer for a `tokenizer.ggml.pre` value; `None` (key absent) is llama.cpp's
    /// `default`, which it accepts with a loud warning; `None` is returned for unknown names.
    pub fn from_name(name: Option<&str>) -> Option<PreTokenizer> {
        let default = || PreTokenizer::new("default", &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]);
        let Some(name) = name else {
            return Some(default());
        };
        let p = match name {
            "default" => default(),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
            | "jina-v5-nano" => PreTokenizer::new("llama3", &[LLAMA3]).ignore_merges().add_bos(),
            "dbrx" | "smaug-bpe" => PreTokenizer::new("dbrx", &[LLAMA3]),
            "chatglm-bpe" => PreTokenizer { no_bos: true, ..PreTokenizer::new("chatglm4", &[LLAMA3]) },
            "glm4" | "glm5" => {
                PreTokenizer { no_bos: true, ..PreTokenizer::new("chatglm4", &[LLAMA3]).ignore_merges() }
            }
            "deepseek-llm" => PreTokenizer::new("deepseek-llm", &DEEPSEEK_LLM),
            "deepseek-coder" => PreTokenizer::new("deepseek-coder", &DEEPSEEK_CODER),
            "deepseek-v3" => PreTokenizer::new("deepseek3-llm", &DEEPSEEK3),
            "falcon" => PreTokenizer::new("falcon", &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"]),
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
                PreTokenizer::new("starcoder", &[r"\p{N}", GPT2])
            }
            "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
            | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "exaone4"
            | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" => PreTokenizer::new("gpt2", &[GPT2]),
            "jais-2" => PreTokenizer::new("jais2", &[JAIS2]),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" | "solar-open" => {
                PreTokenizer::new("qwen2", &[QWEN2])
            }
            "qwen35" => PreTokenizer::new("qwen35", &[QWEN35]),
            "poro-chat" | "bloom" | "gpt3-finnish" => PreTokenizer::new("bloom", &[BLOOM]),
            "viking" => PreTokenizer::new("viking", &[BLOOM, r"\p{N}"]),
            "tekken" => PreTokenizer::new("tekken", &[TEKKEN]).ignore_merges().add_bos(),
            "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => PreTokenizer::new("gpt4o", &[GPT4O]),
            "seed-coder" => PreTokenizer::new("seed-coder", &[SEED_CODER]),
            "bailingmoe" | "bailingmoe2" | "llada-moe" => PreTokenizer::new("bailingmoe", &[BAILINGMOE]),
            "grok-2" => PreTokenizer::new("grok-2", &[QWEN2]),
            "ufakzeka" => PreTokenizer::new("ufakzeka", &[UFAKZEKA]),
            "minicpm5" => PreTokenizer::new("minicpm5", &[r"\p{N}{1,3}", MINICPM5]).ignore_merges(),
            "exaone-moe" => PreTokenizer::new("exaone-moe", &[EXAONE_MOE]),
            "laguna" => PreTokenizer::new("laguna", &[r"[^\n]+|[\n]+", QWEN2]),
            _ => return None,
        };
        Some(p)
    }
}

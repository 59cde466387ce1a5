//! The pre-tokenizer regexes each `tokenizer.ggml.pre` name stands for (llama.cpp's table).

const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's split regex (case-insensitive contractions spelled out).
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: Llama 3's with single digits.
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a `tokenizer.ggml.pre` name implies for a BPE vocabulary.
pub(super) struct PreTokenizerSpec {
    pub(super) regexes: Vec<&'static str>,
    /// A word that is itself a vocabulary entry becomes that token without merging.
    pub(super) ignore_merges: bool,
    /// Default for `add_bos_token` when the metadata does not say.
    pub(super) add_bos: bool,
    /// The pre-tokenizer's model has no BOS token unless the metadata names one.
    pub(super) no_default_bos: bool,
}

/// The split regexes llama.cpp uses for each pre-tokenizer name (llama-vocab.cpp).
pub(super) fn pre_tokenizer_spec(name: &str) -> Option<PreTokenizerSpec> {
    let spec = |regexes: Vec<&'static str>| PreTokenizerSpec {
        regexes,
        ignore_merges: false,
        add_bos: false,
        no_default_bos: false,
    };
    let spec = match name {
        "default" => spec(vec![
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => PreTokenizerSpec {
            ignore_merges: true,
            add_bos: true,
            ..spec(vec![RE_LLAMA3])
        },
        "dbrx" | "smaug-bpe" => spec(vec![RE_LLAMA3]),
        "glm4" | "chatglm-bpe" => PreTokenizerSpec {
            no_default_bos: true,
            ..spec(vec![RE_LLAMA3])
        },
        "deepseek-llm" => spec(vec![
            "[\r\n]",
            r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}+",
        ]),
        "deepseek-coder" => spec(vec![
            "[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ]),
        "deepseek-v3" | "hunyuan-dense" => spec(vec![
            r"\p{N}{1,3}",
            "[一-龥぀-ゟ゠-ヿ]+",
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
        ]),
        "falcon" => spec(vec![
            r"[\p{P}\$\+<=>\^~\|`]+",
            RE_GPT2,
            "[0-9][0-9][0-9]",
        ]),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            spec(vec![r"\p{N}", RE_GPT2])
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo"
        | "jais" | "exaone4" | "trillion" => spec(vec![RE_GPT2]),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" => spec(vec![RE_QWEN2]),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec(vec![RE_BLOOM]),
        "viking" => spec(vec![RE_BLOOM, r"\p{N}"]),
        "tekken" => PreTokenizerSpec {
            ignore_merges: true,
            add_bos: true,
            ..spec(vec![RE_TEKKEN])
        },
        "chameleon" => PreTokenizerSpec {
            add_bos: true,
            ..spec(vec![
                "<sentinel:[0-9]+>",
                "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                "([\\t\\n]|    |  )",
                r"\p{N}",
                r"[\p{P}!-/:-@\[-`{-~]",
                RE_GPT2,
            ])
        },
        "gpt-4o" | "llama4" => spec(vec![RE_GPT4O]),
        "bailingmoe" => spec(vec![
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ]),
        "seed-coder" => spec(vec![
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ]),
        _ => return None,
    };
    Some(spec)
}

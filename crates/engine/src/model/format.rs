//! How weight matrices are held in memory and multiplied (`--weights`).

use std::str::FromStr;

/// How weight matrices are held in memory and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Dequantized to f32 at load; matrix products through a GEMM. Exact reference mode.
    F32,
    /// Requantized at load to Q8_0 and multiplied by candle's kernels, which also quantize
    /// the activations to 8 bits.
    Q8_0,
    /// Kept in the file's own blocks. Q4_0, Q4_1 and Q8_0 are multiplied by Strata's
    /// kernels ([`crate::kernels`]): rows of 4-bit weights, and of a Q8_0 `lm_head`, with
    /// 8-bit activations unless [`super::Model::q8_prompt`] (prompt rows) or
    /// [`super::Model::q8_decode`] (decode rows) is off, with f32 activations otherwise. Other
    /// types by candle's.
    Gguf,
}

impl FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "q8_0" => Ok(Self::Q8_0),
            "gguf" => Ok(Self::Gguf),
            other => Err(format!(
                "unknown weight format `{other}` (expected f32, q8_0 or gguf)"
            )),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Q8_0 => "q8_0",
            Self::Gguf => "gguf",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_format_parses() {
        assert_eq!("q8_0".parse::<WeightFormat>(), Ok(WeightFormat::Q8_0));
        assert!("q4".parse::<WeightFormat>().is_err());
    }
}

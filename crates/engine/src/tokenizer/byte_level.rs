//! GPT-2's byte-level alphabet and SPM byte tokens.

use std::collections::HashMap;

/// GPT-2's reversible byte <-> printable-character mapping.
pub(super) fn byte_level_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            let code = 256 + next_extra;
            next_extra += 1;
            code
        };
        table[usize::from(b)] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// Bytes a byte-level BPE token text stands for. Characters outside the byte
/// alphabet are kept as their own UTF-8 bytes.
pub(super) fn byte_level_decode(text: &str, reverse: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match reverse.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Parses an SPM byte token text `<0xNN>`.
pub(super) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

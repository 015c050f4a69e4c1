//! The compact per-step logprobs transfer: one flat `u32` buffer from the sampling side to the
//! output side instead of a vector of vectors per sequence. Layout, in words:
//! `[header, R, row 0, .., row R-1]`, each row being `cols` token ids, `cols` f32 logprob bit
//! patterns and the sampled token's rank; column 0 is the sampled token, columns 1.. its top
//! alternatives. The header packs a message flag (low 8 bits) and `cols` (high 24 bits). Ranges
//! are checked, never truncated. Not a wire format across machines (native word order in memory).

use super::logprobs::RankedLogprob;
use crate::api::TokenLogprob;

/// Largest message flag (8 bits).
pub const MAX_FLAG: u32 = 0xff;
/// Largest column count (24 bits).
pub const MAX_COLS: u32 = (1 << 24) - 1;

/// Why a buffer could not be packed or unpacked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    #[error("message flag {flag} does not fit in the header's 8 bits (max {MAX_FLAG})")]
    FlagOutOfRange { flag: u32 },
    #[error("{cols} logprob columns do not fit in the header's 24 bits (max {MAX_COLS})")]
    TooManyColumns { cols: u32 },
    #[error("row {row} has {alternatives} alternatives but {cols} columns need {} (plus the sampled token)", cols.saturating_sub(1))]
    RowWidth { row: usize, cols: u32, alternatives: usize },
    #[error("{rows} rows cannot be packed with 0 columns: column 0 is the sampled token")]
    NoColumns { rows: u64 },
    #[error("{rows} rows do not fit in the buffer's u32 row count")]
    TooManyRows { rows: usize },
    #[error("packed logprobs buffer is truncated: its header describes {expected} words, got {got}")]
    Truncated { expected: u64, got: usize },
    #[error("packed logprobs buffer has {got} words but its header describes only {expected}")]
    TrailingWords { expected: u64, got: usize },
}

/// A decoded header word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Message flag, 0..=255; its meaning belongs to the caller.
    pub flag: u32,
    /// Columns per row: the sampled token plus `cols - 1` alternatives.
    pub cols: u32,
}

/// `flag | cols << 8`, refusing values that do not fit.
pub fn pack_header(flag: u32, cols: u32) -> Result<u32, PackError> {
    if flag > MAX_FLAG {
        return Err(PackError::FlagOutOfRange { flag });
    }
    if cols > MAX_COLS {
        return Err(PackError::TooManyColumns { cols });
    }
    Ok(flag | cols << 8)
}

/// Every `u32` is a valid header.
pub fn unpack_header(word: u32) -> Header {
    Header { flag: word & MAX_FLAG, cols: word >> 8 }
}

/// One step's packed logprobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedLogprobs {
    words: Vec<u32>,
}

impl PackedLogprobs {
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    pub fn into_words(self) -> Vec<u32> {
        self.words
    }
}

/// What [`unpack`] recovers.
#[derive(Clone, Debug, PartialEq)]
pub struct Unpacked {
    pub flag: u32,
    pub cols: u32,
    pub rows: Vec<RankedLogprob>,
}

/// Words a buffer of `rows` rows of `cols` columns occupies (u64: cannot overflow for any header).
fn buffer_words(rows: u64, cols: u32) -> u64 {
    2 + rows * (2 * u64::from(cols) + 1)
}

/// Packs `rows` with `cols` columns each; every row must carry exactly `cols - 1` alternatives
/// (`batch_logprobs` gives every row the batch's largest k).
pub fn pack(rows: &[RankedLogprob], cols: u32, flag: u32) -> Result<PackedLogprobs, PackError> {
    let header = pack_header(flag, cols)?;
    let num_rows = u32::try_from(rows.len()).map_err(|_| PackError::TooManyRows { rows: rows.len() })?;
    if cols == 0 && !rows.is_empty() {
        return Err(PackError::NoColumns { rows: rows.len() as u64 });
    }
    for (row, r) in rows.iter().enumerate() {
        if r.logprob.top.len() as u64 + 1 != u64::from(cols) {
            return Err(PackError::RowWidth { row, cols, alternatives: r.logprob.top.len() });
        }
    }
    let mut words = Vec::with_capacity(buffer_words(rows.len() as u64, cols) as usize);
    words.push(header);
    words.push(num_rows);
    for r in rows {
        let entry = &r.logprob;
        words.push(entry.token);
        words.extend(entry.top.iter().map(|&(t, _)| t));
        words.push(entry.logprob.to_bits());
        words.extend(entry.top.iter().map(|&(_, lp)| lp.to_bits()));
        words.push(r.rank);
    }
    Ok(PackedLogprobs { words })
}

/// Reads a buffer written by [`pack`], checking its length against its header.
pub fn unpack(words: &[u32]) -> Result<Unpacked, PackError> {
    let [header, num_rows, body @ ..] = words else {
        return Err(PackError::Truncated { expected: 2, got: words.len() });
    };
    let Header { flag, cols } = unpack_header(*header);
    let expected = buffer_words(u64::from(*num_rows), cols);
    if (words.len() as u64) < expected {
        return Err(PackError::Truncated { expected, got: words.len() });
    }
    if (words.len() as u64) > expected {
        return Err(PackError::TrailingWords { expected, got: words.len() });
    }
    if cols == 0 && *num_rows > 0 {
        return Err(PackError::NoColumns { rows: u64::from(*num_rows) });
    }
    let c = cols as usize;
    let rows = body
        .chunks_exact(2 * c + 1)
        .map(|row| {
            let (ids, rest) = row.split_at(c);
            let (logprobs, rank) = rest.split_at(c);
            let top = ids[1..].iter().zip(&logprobs[1..]).map(|(&t, &lp)| (t, f32::from_bits(lp))).collect();
            RankedLogprob { logprob: TokenLogprob { token: ids[0], logprob: f32::from_bits(logprobs[0]), top }, rank: rank[0] }
        })
        .collect();
    Ok(Unpacked { flag, cols, rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(token: u32, logprob: f32, top: &[(u32, f32)], rank: u32) -> RankedLogprob {
        RankedLogprob { logprob: TokenLogprob { token, logprob, top: top.to_vec() }, rank }
    }

    #[test]
    fn header_packs_flag_low_and_columns_high() {
        assert_eq!(pack_header(0x12, 3), Ok(0x0000_0312));
        assert_eq!(unpack_header(0x0000_0312), Header { flag: 0x12, cols: 3 });
    }

    #[test]
    fn header_edges_round_trip() {
        for (flag, cols) in [(0, 0), (255, 0), (0, MAX_COLS), (255, MAX_COLS), (1, 21)] {
            let word = pack_header(flag, cols).unwrap();
            assert_eq!(unpack_header(word), Header { flag, cols });
        }
        assert_eq!(pack_header(255, MAX_COLS), Ok(u32::MAX));
    }

    #[test]
    fn header_refuses_values_that_do_not_fit() {
        assert_eq!(pack_header(256, 1), Err(PackError::FlagOutOfRange { flag: 256 }));
        assert_eq!(pack_header(0, 1 << 24), Err(PackError::TooManyColumns { cols: 1 << 24 }));
        assert_eq!(pack(&[], 1 << 24, 0), Err(PackError::TooManyColumns { cols: 1 << 24 }));
        assert_eq!(pack(&[], 0, 256), Err(PackError::FlagOutOfRange { flag: 256 }));
    }

    #[test]
    fn rows_round_trip_bit_for_bit() {
        let rows = vec![row(7, -0.5, &[(7, -0.5), (3, -1.25)], 1), row(9, f32::NEG_INFINITY, &[(1, -0.0), (2, f32::MIN_POSITIVE)], 40_000)];
        let packed = pack(&rows, 3, 255).unwrap();
        assert_eq!(packed.words().len(), 2 + 2 * 7);
        assert_eq!(&packed.words()[..2], &[3 << 8 | 255, 2]);
        // Row 0: ids, then logprob bits, then rank.
        assert_eq!(&packed.words()[2..5], &[7, 7, 3]);
        assert_eq!(packed.words()[5], (-0.5f32).to_bits());
        assert_eq!(packed.words()[8], 1);
        let back = unpack(packed.words()).unwrap();
        assert_eq!(back, Unpacked { flag: 255, cols: 3, rows: rows.clone() });
        assert_eq!(back.rows[1].logprob.top[0].1.to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn one_column_carries_only_the_sampled_token() {
        let rows = vec![row(5, -2.0, &[], 12)];
        let packed = pack(&rows, 1, 0).unwrap();
        assert_eq!(packed.words(), &[1 << 8, 1, 5, (-2.0f32).to_bits(), 12]);
        assert_eq!(unpack(packed.words()).unwrap().rows, rows);
    }

    #[test]
    fn zero_columns_round_trip_only_without_rows() {
        let packed = pack(&[], 0, 9).unwrap();
        assert_eq!(packed.words(), &[9, 0]);
        assert_eq!(unpack(packed.words()), Ok(Unpacked { flag: 9, cols: 0, rows: vec![] }));
        assert_eq!(pack(&[row(1, 0.0, &[], 1)], 0, 0), Err(PackError::NoColumns { rows: 1 }));
        assert_eq!(unpack(&[0, 2, 0, 0]), Err(PackError::NoColumns { rows: 2 }));
    }

    #[test]
    fn maximum_columns_pack_as_a_header_only_message() {
        let packed = pack(&[], MAX_COLS, 255).unwrap();
        assert_eq!(packed.words(), &[u32::MAX, 0]);
        assert_eq!(unpack(packed.words()), Ok(Unpacked { flag: 255, cols: MAX_COLS, rows: vec![] }));
        // One row of that width would need 2 * (2^24 - 1) + 1 more words.
        assert_eq!(unpack(&[u32::MAX, 1]), Err(PackError::Truncated { expected: 2 + 33_554_431, got: 2 }));
    }

    #[test]
    fn rows_of_the_wrong_width_are_refused() {
        let rows = vec![row(1, -1.0, &[(1, -1.0)], 1), row(2, -1.0, &[], 2)];
        assert_eq!(pack(&rows, 2, 0), Err(PackError::RowWidth { row: 1, cols: 2, alternatives: 0 }));
    }

    #[test]
    fn truncated_and_overlong_buffers_are_refused() {
        let rows = vec![row(4, -0.1, &[(4, -0.1)], 1), row(6, -0.2, &[(6, -0.2)], 1)];
        let words = pack(&rows, 2, 1).unwrap().into_words();
        assert_eq!(words.len(), 12);
        for len in 2..12 {
            assert_eq!(unpack(&words[..len]), Err(PackError::Truncated { expected: 12, got: len }));
        }
        assert_eq!(unpack(&words[..1]), Err(PackError::Truncated { expected: 2, got: 1 }));
        assert_eq!(unpack(&[]), Err(PackError::Truncated { expected: 2, got: 0 }));
        let mut long = words.clone();
        long.push(0);
        assert_eq!(unpack(&long), Err(PackError::TrailingWords { expected: 12, got: 13 }));
        // A corrupted row count is caught by the length check, not by reading past the end.
        let mut lying = words;
        lying[1] = u32::MAX;
        assert!(matches!(unpack(&lying), Err(PackError::Truncated { .. })));
    }
}

//! Hostile GGUF files against the real binary: the header of a tiny model (and, where the
//! default model is available, of SmolLM2) mutated field by field and at random, each loaded by
//! `specula debug check-model` in a child process. Never a signal, never a panic, never a hang;
//! a mutation that makes the file impossible is a one-line error and exit 1.
//!
//! The header is walked here by its own small reader (not the loader's parser), which records
//! where every length, count, type, dimension, offset and hyper-parameter lies.

use specula_model::testing::{model_for_tests, write_tiny_llama, GgmlDType, SplitMix64, TinySpec};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a field of the header is.
#[derive(Clone, Debug, PartialEq)]
enum Kind {
    TensorCount,
    MetaCount,
    KeyLen,
    ValueType,
    StringLen,
    ArrayType,
    ArrayLen,
    /// A scalar metadata value of this GGUF value type.
    Scalar(u32),
    TensorNameLen,
    NDims,
    Dim,
    TensorType,
    TensorOffset,
}

#[derive(Clone, Debug)]
struct Field {
    kind: Kind,
    pos: usize,
    width: usize,
    /// The metadata key or tensor name the field belongs to.
    owner: String,
    value: u64,
}

/// The fields of a GGUF v2/v3 header, in file order, and where the tensor data starts.
struct Layout {
    fields: Vec<Field>,
    data_offset: usize,
    /// Tensor names in directory order.
    tensors: Vec<String>,
}

struct Walk<'a> {
    b: &'a [u8],
    pos: usize,
    fields: Vec<Field>,
}

impl Walk<'_> {
    fn read(&mut self, kind: Option<Kind>, width: usize, owner: &str) -> u64 {
        assert!(self.pos + width <= self.b.len(), "the header runs past the {} bytes read", self.b.len());
        let mut v = [0u8; 8];
        v[..width].copy_from_slice(&self.b[self.pos..self.pos + width]);
        let value = u64::from_le_bytes(v);
        if let Some(kind) = kind {
            self.fields.push(Field { kind, pos: self.pos, width, owner: owner.into(), value });
        }
        self.pos += width;
        value
    }

    fn string(&mut self, kind: Option<Kind>, owner: &str) -> String {
        let len = self.read(kind, 8, owner) as usize;
        let s = String::from_utf8_lossy(&self.b[self.pos..self.pos + len]).into_owned();
        self.pos += len;
        s
    }

    /// One value of type `ty`; scalars at the top level are recorded, array elements are not.
    fn value(&mut self, ty: u32, key: &str, top: bool) {
        let width = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                self.string(top.then_some(Kind::StringLen), key);
                return;
            }
            9 => {
                let elem = self.read(Some(Kind::ArrayType), 4, key) as u32;
                let n = self.read(Some(Kind::ArrayLen), 8, key);
                for _ in 0..n {
                    self.value(elem, key, false);
                }
                return;
            }
            other => panic!("value type {other} in a file we wrote"),
        };
        self.read(top.then_some(Kind::Scalar(ty)), width, key);
    }
}

fn layout(bytes: &[u8]) -> Layout {
    assert_eq!(&bytes[..4], b"GGUF");
    let version = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
    assert!(version == 2 || version == 3, "the walker reads GGUF v2 and v3 (the same layout), not {version}");
    let mut w = Walk { b: bytes, pos: 8, fields: Vec::new() };
    let n_tensors = w.read(Some(Kind::TensorCount), 8, "");
    let n_meta = w.read(Some(Kind::MetaCount), 8, "");
    let mut alignment = 32;
    for _ in 0..n_meta {
        let key = w.string(Some(Kind::KeyLen), "");
        let ty = w.read(Some(Kind::ValueType), 4, &key) as u32;
        w.value(ty, &key, true);
        if key == "general.alignment" {
            alignment = w.fields.last().unwrap().value as usize;
        }
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = w.string(Some(Kind::TensorNameLen), "");
        let n_dims = w.read(Some(Kind::NDims), 4, &name);
        for _ in 0..n_dims {
            w.read(Some(Kind::Dim), 8, &name);
        }
        w.read(Some(Kind::TensorType), 4, &name);
        w.read(Some(Kind::TensorOffset), 8, &name);
        tensors.push(name);
    }
    Layout { fields: w.fields, data_offset: w.pos.next_multiple_of(alignment), tensors }
}

/// What the loader must do with a mutated file.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// The file is impossible: exit 1 with a one-line error.
    Error,
    /// The file is still a valid model: exit 0.
    Load,
    /// Either, but never a signal, a panic or a hang.
    NoCrash,
}

struct Case {
    label: String,
    /// The header (or whole file) after the mutation: written over a copy of the original.
    bytes: Vec<u8>,
    expect: Expect,
}

fn put(bytes: &mut [u8], f: &Field, v: u64) {
    bytes[f.pos..f.pos + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
}

/// A seed names one sequence of mutations.
struct Rng(SplitMix64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Bytes per element of the five types the tiny writer uses (ggml's block sizes).
fn bytes_per_32(ty: u64) -> Option<u64> {
    Some(match ty {
        0 => 128, // F32
        1 => 64,  // F16
        2 => 18,  // Q4_0
        3 => 20,  // Q4_1
        8 => 34,  // Q8_0
        _ => return None,
    })
}

/// The mutations of `header` (the bytes before the tensor data): each field class with values
/// that make the file impossible, shifts whose outcome is open, and `random` seeded byte edits.
fn cases(header: &[u8], l: &Layout, random: usize, seed: u64) -> Vec<Case> {
    let mut out = Vec::new();
    let mut case = |label: String, f: &Field, v: u64, expect: Expect| {
        let mut bytes = header.to_vec();
        put(&mut bytes, f, v);
        out.push(Case { label: format!("{label} ({} {:?} at {}: {} -> {v})", f.owner, f.kind, f.pos, f.value), bytes, expect });
    };
    let of = |k: Kind| l.fields.iter().filter(move |f| f.kind == k);
    // a few of each kind: first, middle, last
    let some = |k: Kind| {
        let all: Vec<&Field> = of(k).collect();
        let mut pick: Vec<&Field> = [0, all.len() / 2, all.len().saturating_sub(1)].iter().filter_map(|&i| all.get(i).copied()).collect();
        pick.dedup_by_key(|f| f.pos);
        pick
    };
    let huge = [u64::MAX, 1 << 40, u64::MAX / 2];
    for f in of(Kind::TensorCount).chain(of(Kind::MetaCount)) {
        for v in [0, huge[0], huge[1], huge[2]] {
            case("count".into(), f, v, Expect::Error);
        }
        case("count + 1".into(), f, f.value + 1, Expect::NoCrash);
        case("count - 1".into(), f, f.value - 1, Expect::NoCrash);
    }
    for k in [Kind::KeyLen, Kind::StringLen, Kind::TensorNameLen] {
        for f in some(k) {
            for v in [huge[0], huge[1], header.len() as u64 * 4] {
                case("length".into(), f, v, Expect::Error);
            }
            case("length + 1".into(), f, f.value + 1, Expect::NoCrash);
            case("length - 1".into(), f, f.value.saturating_sub(1), Expect::NoCrash);
        }
    }
    for f in of(Kind::ArrayLen) {
        for v in [huge[0], huge[1], (1 << 23) + 1, f.value * 64 + 1_000_000] {
            case("array length".into(), f, v, Expect::Error);
        }
        case("array length - 1".into(), f, f.value.saturating_sub(1), Expect::NoCrash);
    }
    for f in some(Kind::ValueType).into_iter().chain(some(Kind::ArrayType)) {
        for v in [13, 0xFFFF_FFFF] {
            case("value type".into(), f, v, Expect::Error);
        }
        for v in [0, 4, 8, 9, 10, 12] {
            case("other value type".into(), f, v, Expect::NoCrash);
        }
    }
    for f in of(Kind::NDims).step_by(7) {
        for v in [0, 5, 0xFFFF_FFFF] {
            case("dimension count".into(), f, v, Expect::Error);
        }
        case("dimension count + 1".into(), f, f.value + 1, Expect::NoCrash);
    }
    // every dimension change changes the byte size: past the packed offsets or the file
    for f in of(Kind::Dim).step_by(3) {
        for v in [0, huge[0], 1 << 62, f.value * 2, f.value + 1] {
            case("dimension".into(), f, v, Expect::Error);
        }
    }
    let last = l.tensors.last().cloned().unwrap_or_default();
    for f in of(Kind::TensorType).step_by(2) {
        for v in [1000, 31, 4, 0xFFFF_FFFF] {
            case("tensor type".into(), f, v, Expect::Error);
        }
        for v in [0, 1, 2, 3, 8] {
            // another size per element moves the next tensor: impossible unless it is the last
            let other_size = bytes_per_32(v) != bytes_per_32(f.value);
            let expect = if other_size && f.owner != last { Expect::Error } else { Expect::NoCrash };
            if v != f.value {
                case("other tensor type".into(), f, v, expect);
            }
        }
    }
    let offsets: Vec<&Field> = of(Kind::TensorOffset).collect();
    for (i, f) in offsets.iter().enumerate() {
        if i % 5 != 0 && i != offsets.len() - 1 {
            continue;
        }
        for v in [u64::MAX - 15, u64::MAX - 31, 1 << 40, f.value + 1, f.value + 32, f.value.wrapping_sub(32)] {
            case("tensor offset".into(), f, v, Expect::Error);
        }
    }
    // hyper-parameters
    let scalar = |suffix: &str| l.fields.iter().find(|f| matches!(f.kind, Kind::Scalar(_)) && f.owner.ends_with(suffix));
    let arch_u32: [(&str, Vec<u64>); 7] = [
        (".block_count", vec![0, 0xFFFF_FFFF]),
        (".embedding_length", vec![0, 0xFFFF_FFFF]),
        (".feed_forward_length", vec![0, 0xFFFF_FFFF]),
        (".attention.head_count", vec![0, 0xFFFF_FFFF]),
        (".attention.head_count_kv", vec![0, 0xFFFF_FFFF]),
        (".context_length", vec![0, 0xFFFF_FFFF]),
        (".rope.dimension_count", vec![0, 0xFFFF_FFFF]),
    ];
    for (suffix, values) in arch_u32 {
        let Some(f) = scalar(suffix) else { continue };
        let mut values = values;
        // values in range that disagree with the tensors' shapes
        values.extend(match suffix {
            ".block_count" => vec![f.value + 1, f.value - 1],
            ".embedding_length" => vec![f.value + 32, f.value * 2],
            ".feed_forward_length" => vec![f.value + 32],
            ".attention.head_count" => vec![f.value * 2, f.value + 1],
            ".attention.head_count_kv" => vec![f.value * 2],
            ".rope.dimension_count" => vec![f.value + 2],
            _ => vec![],
        });
        for v in values.into_iter().filter(|&v| v != f.value) {
            case("hyper-parameter".into(), f, v, Expect::Error);
        }
    }
    if let Some(f) = scalar(".context_length") {
        case("a shorter context".into(), f, 64, Expect::Load);
    }
    for suffix in [".attention.layer_norm_rms_epsilon", ".rope.freq_base"] {
        let Some(f) = scalar(suffix) else { continue };
        for v in [f32::NAN, f32::INFINITY, -1.0, 0.0] {
            case("hyper-parameter".into(), f, v.to_bits() as u64, Expect::Error);
        }
    }
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
        let Some(f) = scalar(key) else { continue };
        case("special token id".into(), f, 0xFFFF_FFFF, Expect::Error);
        case("special token id".into(), f, 10_000_000, Expect::Error);
    }
    // a required integer stored as a float of the same width
    if let Some(t) = l.fields.iter().find(|f| f.kind == Kind::ValueType && f.owner.ends_with(".block_count")) {
        case("block_count as a float".into(), t, 6, Expect::Error);
    }
    // an unknown architecture (same length)
    if let Some(f) = l.fields.iter().find(|f| f.kind == Kind::StringLen && f.owner == "general.architecture") {
        let mut bytes = header.to_vec();
        bytes[f.pos + 8] ^= 0x20;
        out.push(Case { label: "architecture renamed".into(), bytes, expect: Expect::Error });
    }
    out.push(Case { label: "unchanged".into(), bytes: header.to_vec(), expect: Expect::Load });

    // random: a field set to a random or extreme value, or 1..8 random bytes anywhere in the header
    let mut rng = Rng(SplitMix64(seed));
    for i in 0..random {
        let mut bytes = header.to_vec();
        let label = if i % 2 == 0 {
            let f = &l.fields[rng.below(l.fields.len())];
            let v = match rng.below(4) {
                0 => rng.next(),
                1 => f.value ^ (1 << rng.below(f.width * 8)),
                2 => f.value.wrapping_add(rng.below(64) as u64).wrapping_sub(32),
                _ => u64::MAX,
            };
            put(&mut bytes, f, v);
            format!("random field {i} ({} {:?} at {}: {} -> {v})", f.owner, f.kind, f.pos, f.value)
        } else {
            let n = 1 + rng.below(8);
            let mut at = Vec::new();
            for _ in 0..n {
                let p = rng.below(l.data_offset);
                bytes[p] = rng.next() as u8;
                at.push(p);
            }
            format!("random bytes {i} at {at:?}")
        };
        out.push(Case { label, bytes, expect: Expect::NoCrash });
    }
    out
}

/// What the child did.
struct Outcome {
    code: Option<i32>,
    stderr: String,
}

/// Runs `specula ARGS` with a deadline; a hang is killed and reported.
fn run_specula(args: &[&std::ffi::OsStr], quiet: bool) -> Result<Outcome, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_specula"));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).env("RAYON_NUM_THREADS", "1");
    if quiet {
        cmd.env("SPECULA_LOG", "off");
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot start specula: {e}"))?;
    let mut stderr = child.stderr.take().ok_or("no stderr pipe")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            return Err("hung for 120 s (killed)".into());
        }
        std::thread::sleep(Duration::from_millis(3));
    };
    let stderr = reader.join().unwrap_or_default();
    #[cfg(unix)]
    if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&status) {
        return Err(format!("killed by signal {sig}; stderr: {stderr}"));
    }
    Ok(Outcome { code: status.code(), stderr })
}

/// The verdict on one case: `None` when the loader behaved.
fn judge(expect: Expect, o: Result<Outcome, String>) -> Option<String> {
    let o = match o {
        Ok(o) => o,
        Err(e) => return Some(e),
    };
    if o.stderr.contains("panicked") || o.code == Some(101) {
        return Some(format!("panicked: {}", o.stderr.trim()));
    }
    let one_line_error = o.code == Some(1) && o.stderr.trim().lines().count() == 1 && o.stderr.starts_with("error: ");
    match (expect, o.code) {
        (Expect::Error, Some(0)) => Some("loaded an impossible file".into()),
        (Expect::Load, Some(0)) => None,
        (Expect::Load, _) => Some(format!("refused a valid file: {}", o.stderr.trim())),
        (_, Some(0)) => None,
        (_, Some(1)) if one_line_error => None,
        (_, code) => Some(format!("exit {code:?}, not 0 or a one-line error: {:?}", o.stderr)),
    }
}

/// Runs every case on two threads: each writes its file (the mutated header over a copy of
/// `base`, extended to `len` bytes, sparse where `base` is shorter) and loads it in a child.
fn run_cases(dir: &Path, base: &[u8], len: u64, cases: Vec<Case>) -> (usize, Vec<String>) {
    let n = cases.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for worker in 0..2 {
            let (next, failures, cases) = (&next, &failures, &cases);
            s.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                let path = dir.join(format!("case{worker}.gguf"));
                write_case(&path, base, &c.bytes, len);
                // a file that must load also runs one token through every layer; the others are
                // only loaded (garbage weights may be non-finite, which is not the loader's to see)
                let mut args: Vec<&std::ffi::OsStr> = vec!["debug".as_ref(), "check-model".as_ref(), path.as_os_str()];
                if c.expect == Expect::Load {
                    args.push("--forward".as_ref());
                }
                if let Some(v) = judge(c.expect, run_specula(&args, true)) {
                    let v: String = v.chars().take(400).collect();
                    failures.lock().unwrap().push(format!("{} [{:?}]: {v}", c.label, c.expect));
                }
            });
        }
    });
    (n, failures.into_inner().unwrap())
}

fn write_case(path: &Path, base: &[u8], header: &[u8], len: u64) {
    let mut bytes = base.to_vec();
    bytes[..header.len()].copy_from_slice(header);
    std::fs::write(path, &bytes).unwrap();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

fn tiny_file(dir: &Path, name: &str, spec: &TinySpec) -> (PathBuf, Vec<u8>) {
    let path = dir.join(name);
    write_tiny_llama(&path, spec).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

#[test]
fn mutated_tiny_gguf_headers_never_crash_and_impossible_ones_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    let mut total = 0;
    // a dense Llama in Q4_1 (untied) and a Qwen2 with biases in Q8_0: different tensors and types
    let specs = [
        ("llama.gguf", TinySpec { tied_embeddings: false, ..Default::default() }, 200, 1),
        ("qwen2.gguf", TinySpec { arch: specula_model::Arch::Qwen2, weight_format: GgmlDType::Q8_0, seed: 2, ..Default::default() }, 80, 2),
    ];
    for (name, spec, random, seed) in specs {
        let (_, bytes) = tiny_file(dir.path(), name, &spec);
        let l = layout(&bytes);
        let cases = cases(&bytes, &l, random, seed);
        let (n, failures) = run_cases(dir.path(), &bytes, bytes.len() as u64, cases);
        total += n;
        all.extend(failures.into_iter().map(|f| format!("{name}: {f}")));
    }
    assert!(total > 400, "only {total} cases");
    assert!(all.is_empty(), "{} of {total} mutations misbehaved:\n{}", all.len(), all.join("\n"));
}

/// The real default model's header (SmolLM2: a 49k-token vocabulary, merges, 30 layers) over a
/// sparse copy of its size: the same header bytes, zero weights.
#[test]
fn mutated_real_gguf_headers_never_crash_and_impossible_ones_are_one_line_errors() {
    let Some(model) = model_for_tests("mutated_real_gguf_headers_never_crash_and_impossible_ones_are_one_line_errors") else { return };
    if model.is_dir() {
        return;
    }
    let len = std::fs::metadata(&model).unwrap().len();
    let mut head = vec![0u8; (len as usize).min(32 << 20)];
    std::io::Read::read_exact(&mut std::fs::File::open(&model).unwrap(), &mut head).unwrap();
    let l = layout(&head);
    head.truncate(l.data_offset);
    let all = cases(&head, &l, 30, 7);
    // the named ones, the unchanged header, and every 10th of the others: the real tokenizer
    // takes a while to build, and the tiny files cover the field classes in full
    let keep: Vec<Case> = all
        .into_iter()
        .enumerate()
        .filter(|(i, c)| i % 10 == 0 || c.expect == Expect::Load || c.label.contains("block_count") || c.label.contains("offset"))
        .map(|(_, c)| c)
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let (n, failures) = run_cases(dir.path(), &head, len, keep);
    assert!(failures.is_empty(), "{} of {n} mutations misbehaved:\n{}", failures.len(), failures.join("\n"));
}

/// The two files of issue 38, built from the tiny model and loaded by `serve` and `generate`.
fn observed_case(dir: &Path, which: &str) -> PathBuf {
    let (_, bytes) = tiny_file(dir, "base.gguf", &TinySpec::default());
    let l = layout(&bytes);
    let f = match which {
        "block_count" => l.fields.iter().find(|f| matches!(f.kind, Kind::Scalar(_)) && f.owner.ends_with(".block_count")).unwrap(),
        _ => l.fields.iter().find(|f| f.kind == Kind::TensorOffset).unwrap(),
    };
    let v = if which == "block_count" { 4_294_967_295 } else { u64::MAX - 15 };
    let mut bytes = bytes.clone();
    put(&mut bytes, f, v);
    let path = dir.join(format!("{which}.gguf"));
    std::fs::write(&path, &bytes).unwrap();
    path
}

fn assert_cli_refuses(path: &Path, want: &str) {
    for args in [vec!["serve", "--port", "0", "--model"], vec!["generate", "--prompt", "hi", "--model"], vec!["debug", "check-model"]] {
        let mut a: Vec<&std::ffi::OsStr> = args.iter().map(|s| s.as_ref()).collect();
        a.push(path.as_os_str());
        let o = run_specula(&a, false).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        assert_eq!(o.code, Some(1), "{args:?}: {}", o.stderr);
        let lines: Vec<&str> = o.stderr.trim().lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: not one line: {}", o.stderr);
        assert!(lines[0].starts_with("error: ") && lines[0].contains(want) && lines[0].contains(&path.display().to_string()), "{args:?}: {}", lines[0]);
    }
}

#[test]
fn block_count_of_u32_max_is_a_one_line_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    assert_cli_refuses(&observed_case(dir.path(), "block_count"), "block_count");
}

#[test]
fn first_tensor_offset_of_2_pow_64_minus_16_is_a_one_line_error_not_a_wrap() {
    let dir = tempfile::tempdir().unwrap();
    assert_cli_refuses(&observed_case(dir.path(), "offset"), "offset 18446744073709551600");
}

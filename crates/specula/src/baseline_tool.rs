//! Running a baseline engine's own tool (llama.cpp's `llama-bench` and `llama-perplexity`,
//! ik_llama.cpp's `llama-bench`) beside ours: one place that starts it and turns a failure into
//! one line naming the binary, its exit status and the last line it wrote to stderr.

use anyhow::{Context, Result};
use std::process::{Command, Output};

/// Runs `cmd` to completion; its output if it exited successfully.
pub fn output(cmd: &mut Command) -> Result<Output> {
    let bin = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().with_context(|| format!("running {bin}"))?;
    if !out.status.success() {
        anyhow::bail!("{bin} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_names_the_binary_its_status_and_its_last_error_line() {
        let e = output(Command::new("sh").args(["-c", "echo first >&2; echo 'no such file' >&2; exit 3"])).unwrap_err().to_string();
        assert!(e.starts_with("sh failed (") && e.contains('3') && e.ends_with(": no such file"), "{e}");
        let e = output(&mut Command::new("/nonexistent/llama-bench")).unwrap_err().to_string();
        assert_eq!(e, "running /nonexistent/llama-bench");
        assert_eq!(output(Command::new("sh").args(["-c", "echo ok"])).unwrap().stdout, b"ok\n");
    }
}

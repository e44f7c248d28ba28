//! How the demo shows what it does: numbered steps, and every command it
//! runs printed as a user would type it (with the demo's kubeconfig).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context as _, ensure};

use super::Demo;

/// Prints numbered steps with the time since the start.
pub(super) struct Narrator {
    pub(super) start: Instant,
    pub(super) step: usize,
}

impl Narrator {
    pub(super) fn step(&mut self, title: &str) {
        self.step += 1;
        println!(
            "\n\x1b[1m== {}. {title}\x1b[0m  ({:.1}s)",
            self.step,
            self.start.elapsed().as_secs_f64()
        );
        let _ = std::io::stdout().flush();
    }
}

pub(super) fn say(line: impl AsRef<str>) {
    println!("   {}", line.as_ref());
    let _ = std::io::stdout().flush();
}

impl Demo {
    /// A command with the demo's kubeconfig, so printed commands are the real ones.
    pub(super) fn command(&self, program: &str) -> Command {
        let path = if program == "kubectl" {
            PathBuf::from("kubectl")
        } else {
            self.binaries.path(program)
        };
        let mut cmd = Command::new(path);
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .current_dir(crate::stack::repository_root());
        cmd
    }

    /// Runs `program args` showing the command line and its output; fails on
    /// a non-zero exit.
    pub(super) fn shown(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        say(format!("$ {program} {}", args.join(" ")));
        let out = self
            .command(program)
            .args(args)
            .output()
            .with_context(|| format!("run {program}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        for line in stdout.lines() {
            say(format!("  {line}"));
        }
        ensure!(
            out.status.success(),
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// `left | right`, both real processes, the pipeline shown.
    pub(super) fn piped(
        &self,
        left: (&str, &[&str]),
        right: (&str, &[&str]),
    ) -> anyhow::Result<()> {
        say(format!(
            "$ {} {} | {} {}",
            left.0,
            left.1.join(" "),
            right.0,
            right.1.join(" ")
        ));
        let mut producer = self
            .command(left.0)
            .args(left.1)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("run {}", left.0))?;
        let stdin = producer.stdout.take().context("a pipe")?;
        let consumer = self
            .command(right.0)
            .args(right.1)
            .stdin(stdin)
            .output()
            .with_context(|| format!("run {}", right.0))?;
        let produced = producer.wait_with_output()?;
        ensure!(
            produced.status.success(),
            "`{} {}` failed ({}): {}",
            left.0,
            left.1.join(" "),
            produced.status,
            String::from_utf8_lossy(&produced.stderr)
        );
        for line in String::from_utf8_lossy(&consumer.stdout).lines() {
            say(format!("  {line}"));
        }
        ensure!(
            consumer.status.success(),
            "`{} {}` failed ({}): {}",
            right.0,
            right.1.join(" "),
            consumer.status,
            String::from_utf8_lossy(&consumer.stderr)
        );
        Ok(())
    }

    /// `kubectl --context <context> apply -f -` of `manifests`, shown.
    pub(super) fn apply_shown(&self, context: &str, manifests: &str) -> anyhow::Result<()> {
        say(format!("$ kubectl --context {context} apply -f - <<EOF"));
        for line in manifests.lines() {
            say(format!("  {line}"));
        }
        say("EOF");
        let out = crate::kubectl_output(
            &self.kubeconfig,
            &["--context", context, "apply", "-f", "-"],
            Some(manifests),
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            say(format!("  {line}"));
        }
        ensure!(
            out.status.success(),
            "kubectl --context {context} apply failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Runs `strait <args…> --context east`, prints what it says, and fails
    /// on a non-zero exit (after printing it).
    pub(super) fn strait_report(&self, args: &[&str]) -> anyhow::Result<()> {
        self.strait_report_in("east", args)
    }

    /// `strait ARGS --context CONTEXT`, shown with its output; fails when it does.
    pub(super) fn strait_report_in(&self, context: &str, args: &[&str]) -> anyhow::Result<()> {
        let mut all = args.to_vec();
        all.extend(["--context", context]);
        say(format!("$ strait {}", all.join(" ")));
        let out = self
            .command("strait")
            .args(&all)
            .output()
            .context("run strait")?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        for line in String::from_utf8_lossy(&out.stdout)
            .lines()
            .chain(stderr.lines())
        {
            say(format!("  {line}"));
        }
        ensure!(
            out.status.success(),
            "`strait {}` failed ({}): see its output above",
            all.join(" "),
            out.status
        );
        Ok(())
    }
}

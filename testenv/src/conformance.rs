//! SIG-Multicluster's MCS API conformance suite (`third_party/mcs-api-conformance`,
//! vendored unchanged): built once with `go test -c` into a cache keyed by a
//! hash of its files (as [`crate::controlplane`] builds the control plane), and
//! run against clusters of a kubeconfig, its results parsed from Ginkgo's JSON
//! report.
//!
//! The suite needs the MCS CRDs (`deploy/mcs/crds.yaml`) in every cluster,
//! and pods from two images, which [`crate::images::conformance_archives`]
//! builds for real nodes. It treats the first context as the exporting
//! cluster; specs that need two clusters skip with one.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Name of the test binary in the cache.
pub const BINARY_NAME: &str = "conformance.test";

/// Files the run leaves in its report folder.
pub const JSON_REPORT: &str = "report.json";
pub const JUNIT_REPORT: &str = "junit.xml";
/// The suite's own report (`report.go` writes both into its working folder).
pub const SUITE_HTML_REPORT: &str = "report.html";
pub const SUITE_YAML_REPORT: &str = "report.yaml";
/// Everything the binary printed (stdout and stderr, in order).
pub const LOG: &str = "conformance.log";

/// The labels the suite sorts its specs by.
pub const REQUIRED: &str = "Required";
pub const OPTIONAL: &str = "Optional";

/// What the build hashes besides the sources: the flags it passes.
const GO_FLAGS: &str = "-buildvcs=false -mod=readonly";
const BUILD_ARGS: &[&str] = &["test", "-c", "-trimpath"];

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "the `go` command was not found ({0}): install Go 1.26 or newer, or set STRAIT_MCS_CONFORMANCE_BIN to a prebuilt conformance.test"
    )]
    GoMissing(std::io::Error),
    #[error(
        "the MCS conformance suite is not at {0}: set STRAIT_MCS_CONFORMANCE_SRC to the third_party/mcs-api-conformance folder of a Strait checkout"
    )]
    SourcesMissing(PathBuf),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot prepare the cache at {path}: {source}; set STRAIT_CACHE_DIR to a writable folder"
    )]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "`go mod download` failed ({status}): the suite's modules come from the Go module proxy (GOPROXY={proxy}); check that it is reachable. Its output:\n{output}"
    )]
    Download {
        status: String,
        proxy: String,
        output: String,
    },
    #[error(
        "`go test -c` of the MCS conformance suite failed ({status}); the suite is vendored unchanged, so look at the Go toolchain ({go}). Its output:\n{output}"
    )]
    Compile {
        status: String,
        go: String,
        output: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("the conformance run needs at least one kubeconfig context")]
    NoContexts,
    #[error("cannot prepare the report folder {path}: {source}")]
    ReportDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {binary}: {source}; build it with testenv::conformance::ensure_built()")]
    Start {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the conformance binary exited ({status}) without a Ginkgo report at {report}: it stopped before the suite ran (a bad flag?). Last output (all of it in {log}):\n{tail}"
    )]
    NoReport {
        status: String,
        report: PathBuf,
        log: PathBuf,
        tail: String,
    },
    #[error("cannot read the Ginkgo report {path}: {message}")]
    BadReport { path: PathBuf, message: String },
}

/// Where the suite lives: `STRAIT_MCS_CONFORMANCE_SRC`, else the workspace's
/// `third_party/mcs-api-conformance`.
pub fn source_dir() -> PathBuf {
    std::env::var_os("STRAIT_MCS_CONFORMANCE_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../third_party/mcs-api-conformance")
        })
}

fn go_version() -> Result<String, BuildError> {
    let out = Command::new("go")
        .arg("version")
        .output()
        .map_err(BuildError::GoMissing)?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Hash of every input of the build: the suite's files (Go sources, go.mod,
/// go.sum and the embedded report template; not Strait's README or testdata),
/// the toolchain, the flags and the architecture.
pub fn input_hash(src: &Path) -> Result<String, BuildError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(|_| BuildError::SourcesMissing(src.to_path_buf()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && !p.ends_with("README.md"))
        .collect();
    files.sort();
    if !files.iter().any(|p| p.ends_with("go.mod")) {
        return Err(BuildError::SourcesMissing(src.to_path_buf()));
    }
    let mut hasher = Sha256::new();
    for file in &files {
        let bytes = std::fs::read(file).map_err(|source| BuildError::Read {
            path: file.clone(),
            source,
        })?;
        hasher.update(file.file_name().unwrap_or_default().as_encoded_bytes());
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(&bytes);
    }
    hasher.update(go_version()?.as_bytes());
    hasher.update(GO_FLAGS.as_bytes());
    hasher.update(BUILD_ARGS.join(" ").as_bytes());
    hasher.update(std::env::consts::ARCH.as_bytes());
    Ok(hex::encode(&hasher.finalize()[..12]))
}

/// Returns the path of the built suite, building it first if the cache has
/// none for the current inputs (`~/.cache/strait/mcs-conformance/<hash>/`).
/// `STRAIT_MCS_CONFORMANCE_BIN` overrides.
pub fn ensure_built() -> Result<PathBuf, BuildError> {
    if let Some(bin) = std::env::var_os("STRAIT_MCS_CONFORMANCE_BIN") {
        return Ok(PathBuf::from(bin));
    }
    // Threads of one process wait here; processes wait on the file lock below.
    static IN_PROCESS: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = cached.as_ref() {
        return Ok(path.clone());
    }

    let src = source_dir();
    let hash = input_hash(&src)?;
    let root = crate::controlplane::cache_root().join("mcs-conformance");
    let dir = root.join(&hash);
    let bin = dir.join(BINARY_NAME);
    if !bin.exists() {
        let cache_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| BuildError::Cache { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(cache_err(&dir))?;
        let lock_path = root.join("build.lock");
        let lock = File::create(&lock_path).map_err(cache_err(&lock_path))?;
        if lock.try_lock().is_err() {
            eprintln!(
                "[testenv] another process is building the MCS conformance suite; waiting for it ({})",
                lock_path.display()
            );
            lock.lock().map_err(cache_err(&lock_path))?;
        }
        // The winner of the lock may have built it while we waited.
        if !bin.exists() {
            build(&src, &bin)?;
        }
        drop(lock);
    }
    *cached = Some(bin.clone());
    Ok(bin)
}

fn go_command(src: &Path) -> Command {
    let mut cmd = Command::new("go");
    // GOPROXY and GOMODCACHE stay as the environment has them.
    cmd.current_dir(src)
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", GO_FLAGS)
        .env(
            "GOTOOLCHAIN",
            std::env::var("GOTOOLCHAIN").unwrap_or_else(|_| "local".into()),
        );
    cmd
}

fn go_proxy(src: &Path) -> String {
    go_command(src)
        .args(["env", "GOPROXY"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn build(src: &Path, bin: &Path) -> Result<(), BuildError> {
    let started = Instant::now();
    eprintln!(
        "[testenv] building the MCS conformance suite (go test -c) into {}\n[testenv] a cold build takes about 1.5 minutes on 2 cores; later runs reuse it",
        bin.display()
    );
    let out = go_command(src)
        .args(["mod", "download"])
        .output()
        .map_err(BuildError::GoMissing)?;
    if !out.status.success() {
        return Err(BuildError::Download {
            status: out.status.to_string(),
            proxy: go_proxy(src),
            output: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let tmp = bin.with_extension("partial");
    let out = go_command(src)
        .args(BUILD_ARGS)
        .arg("-o")
        .arg(&tmp)
        .arg(".")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(BuildError::GoMissing)?;
    if !out.status.success() || !tmp.exists() {
        let _ = std::fs::remove_file(&tmp);
        return Err(BuildError::Compile {
            status: out.status.to_string(),
            go: go_version()?,
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    std::fs::rename(&tmp, bin).map_err(|source| BuildError::Cache {
        path: bin.to_path_buf(),
        source,
    })?;
    eprintln!(
        "[testenv] MCS conformance suite built in {}s: {}",
        started.elapsed().as_secs(),
        bin.display()
    );
    Ok(())
}

/// How to run the suite. Every flag the suite defines (conformance_suite.go)
/// has a field; Ginkgo's own flags go in `extra_args`.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// `-kubeconfig`: one file with every context.
    pub kubeconfig: PathBuf,
    /// `-contexts`: the first is the cluster that exports.
    pub contexts: Vec<String>,
    /// `--ginkgo.label-filter`, e.g. `Required` or `Required || (Optional && !Connectivity)`;
    /// empty runs every spec, and one that selects none fails the run.
    pub label_filter: String,
    /// Where the reports and the log go; also the binary's working folder,
    /// since the suite writes `report.html` and `report.yaml` into it.
    pub report_dir: PathBuf,
    /// `-skip-verify-eps-managed-by`: only check that MCS EndpointSlices have
    /// a managed-by label, not that it differs from the EndpointSlice controller's.
    pub skip_verify_eps_managed_by: bool,
    /// `-dns-domain` (the suite's default: `clusterset.local`).
    pub dns_domain: Option<String>,
    /// `-organization`, `-project`, `-version`, `-url`: shown in report.html.
    pub organization: Option<String>,
    pub project: Option<String>,
    pub version: Option<String>,
    pub url: Option<String>,
    /// `--ginkgo.timeout` for the whole suite (Ginkgo's default: 1 h).
    pub timeout: Option<Duration>,
    /// `--ginkgo.dry-run`: walk the specs without running anything (every
    /// selected spec then reports passed).
    pub dry_run: bool,
    /// More flags, appended last, e.g. `--ginkgo.focus=…`.
    pub extra_args: Vec<String>,
}

impl RunOptions {
    pub fn new(
        kubeconfig: impl Into<PathBuf>,
        contexts: &[&str],
        label_filter: &str,
        report_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            kubeconfig: kubeconfig.into(),
            contexts: contexts.iter().map(|c| c.to_string()).collect(),
            label_filter: label_filter.into(),
            report_dir: report_dir.into(),
            ..Self::default()
        }
    }

    /// The binary's arguments (paths absolute: it runs in `report_dir`).
    pub fn args(&self) -> Vec<String> {
        let report_dir = absolute(&self.report_dir);
        let mut args = vec![
            format!("-kubeconfig={}", absolute(&self.kubeconfig).display()),
            format!("-contexts={}", self.contexts.join(",")),
            format!("--ginkgo.label-filter={}", self.label_filter),
            "--ginkgo.v".into(),
            "--ginkgo.no-color".into(),
            // A filter that selects nothing (a typo) fails the run instead of
            // passing with every spec skipped.
            "--ginkgo.fail-on-empty".into(),
            format!(
                "--ginkgo.json-report={}",
                report_dir.join(JSON_REPORT).display()
            ),
            format!(
                "--ginkgo.junit-report={}",
                report_dir.join(JUNIT_REPORT).display()
            ),
        ];
        if self.skip_verify_eps_managed_by {
            args.push("-skip-verify-eps-managed-by".into());
        }
        for (flag, value) in [
            ("dns-domain", &self.dns_domain),
            ("organization", &self.organization),
            ("project", &self.project),
            ("version", &self.version),
            ("url", &self.url),
        ] {
            if let Some(value) = value {
                args.push(format!("-{flag}={value}"));
            }
        }
        if let Some(timeout) = self.timeout {
            args.push(format!("--ginkgo.timeout={}s", timeout.as_secs().max(1)));
        }
        if self.dry_run {
            args.push("--ginkgo.dry-run".into());
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Runs the suite `binary` (from [`ensure_built`]) against `contexts` of
/// `kubeconfig`, with the specs `label_filter` selects; reports go to
/// `report_dir`. Failing specs are a [`Summary`], not an error.
pub fn run(
    binary: &Path,
    kubeconfig: &Path,
    contexts: &[&str],
    label_filter: &str,
    report_dir: &Path,
) -> Result<Summary, RunError> {
    run_with(
        binary,
        &RunOptions::new(kubeconfig, contexts, label_filter, report_dir),
    )
}

/// [`run`] with every option. Each line the binary prints goes to stderr
/// (prefixed `[mcs-conformance]`) and to `report_dir/conformance.log`.
pub fn run_with(binary: &Path, options: &RunOptions) -> Result<Summary, RunError> {
    if options.contexts.is_empty() {
        return Err(RunError::NoContexts);
    }
    let report_dir = absolute(&options.report_dir);
    let dir_err = |source| RunError::ReportDir {
        path: report_dir.clone(),
        source,
    };
    std::fs::create_dir_all(&report_dir).map_err(dir_err)?;
    let json_path = report_dir.join(JSON_REPORT);
    // A report of an earlier run must not pass for this one's.
    match std::fs::remove_file(&json_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(dir_err(e)),
        _ => {}
    }
    let log_path = report_dir.join(LOG);
    let mut log = File::create(&log_path).map_err(dir_err)?;

    // One pipe for stdout and stderr keeps Ginkgo's report and client-go's
    // messages in the order they were written.
    let (reader, writer) = std::io::pipe().map_err(dir_err)?;
    let mut cmd = Command::new(binary);
    cmd.args(options.args())
        .current_dir(&report_dir)
        .stdin(Stdio::null())
        .stdout(writer.try_clone().map_err(dir_err)?)
        .stderr(writer);
    let start_err = |source| RunError::Start {
        binary: binary.to_path_buf(),
        source,
    };
    let mut child = cmd.spawn().map_err(start_err)?;
    // The command holds the pipe's write ends: without dropping it the read
    // below would never see the end.
    drop(cmd);
    let mut output = String::new();
    for line in BufReader::new(reader).lines().map_while(Result::ok) {
        eprintln!("[mcs-conformance] {line}");
        let _ = writeln!(log, "{line}");
        output.push_str(&line);
        output.push('\n');
    }
    let status = child.wait().map_err(start_err)?;

    let json = match std::fs::read_to_string(&json_path) {
        Ok(json) => json,
        Err(_) => {
            let lines: Vec<&str> = output.lines().collect();
            return Err(RunError::NoReport {
                status: status.to_string(),
                report: json_path,
                log: log_path,
                tail: lines[lines.len().saturating_sub(30)..].join("\n"),
            });
        }
    };
    let summary = parse(&json, &output, &report_dir).map_err(|message| RunError::BadReport {
        path: json_path,
        message,
    })?;
    // Straight to the stderr stream, not `eprintln!`: the test harness keeps
    // a passing test's `eprintln!` to itself, and CI's log must show the
    // suite's summary whether it passed or not.
    let _ = writeln!(std::io::stderr(), "{summary}");
    Ok(summary)
}

/// The outcome of one spec, as Ginkgo's state words group them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpecState {
    Passed,
    /// Failed, panicked, timed out, interrupted or aborted.
    Failed,
    /// Skipped by the label filter, or by the spec itself (e.g. one cluster only).
    Skipped,
    Pending,
}

impl SpecState {
    fn from_ginkgo(state: &str) -> Self {
        match state {
            "passed" => Self::Passed,
            "skipped" => Self::Skipped,
            "pending" => Self::Pending,
            _ => Self::Failed,
        }
    }
}

impl fmt::Display for SpecState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so that widths like `{:<7}` line states up.
        f.pad(match self {
            Self::Passed => "passed",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
            Self::Pending => "pending",
        })
    }
}

/// One spec of the run.
#[derive(Clone, Debug)]
pub struct SpecResult {
    /// Container texts and the spec's text joined (the suite's empty
    /// containers left out), e.g. `Connectivity to a service that is not
    /// exported should be inaccessible`.
    pub name: String,
    /// Labels of the containers, then the spec's own, each once, e.g.
    /// `["ClusterIP", "Required"]`.
    pub labels: Vec<String>,
    pub state: SpecState,
    /// Ginkgo's own word: passed, failed, skipped, pending, panicked, timedout,
    /// interrupted or aborted.
    pub ginkgo_state: String,
    /// Ginkgo's failure (or skip) message.
    pub message: Option<String>,
    /// What the suite found not conformant, when the spec failed on it
    /// (otherwise the failure is an error that left conformance unknown).
    pub non_conformant: Option<String>,
    /// The KEP section the spec checks.
    pub spec_ref: Option<String>,
    pub run_time: Duration,
}

impl SpecResult {
    pub fn has_label(&self, label: &str) -> bool {
        self.labels.iter().any(|l| l == label)
    }

    /// Why it failed or skipped, in a line: the non-conformance note, else
    /// the first line of the failure that is not Gomega's framing.
    pub fn reason(&self) -> Option<&str> {
        self.non_conformant
            .as_deref()
            .filter(|n| !n.is_empty())
            .or_else(|| gist(self.message.as_deref()?).next())
    }
}

/// The lines of a Gomega failure that say what went wrong, without its
/// framing (`Timed out after 20.000s.`, `The function passed to Eventually
/// failed at … with:`) and the dumps of values (`<*T | 0x…>: …` and the
/// struct after it).
fn gist(message: &str) -> impl Iterator<Item = &str> {
    const FRAMING: &[&str] = &[
        "Timed out after ",
        "The function passed to ",
        "Expected success, but got an error:",
        "<",
    ];
    message
        .lines()
        .map(str::trim)
        .take_while(|l| *l != "{")
        .filter(|l| !l.is_empty() && !FRAMING.iter().any(|f| l.starts_with(f)))
}

/// Counts from the suite's result line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub passed: usize,
    pub failed: usize,
    pub pending: usize,
    pub skipped: usize,
}

/// Ginkgo's closing lines, e.g. `Ran 14 of 27 Specs in 301.2 seconds` and
/// `FAIL! -- 1 Passed | 13 Failed | 0 Pending | 13 Skipped`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuiteLine {
    /// Both lines as printed, joined by a newline.
    pub text: String,
    pub ran: usize,
    pub total: usize,
    /// `None` when the result line has no counts (`FAIL! -- A BeforeSuite
    /// node failed so all tests were skipped.`).
    pub tally: Option<Tally>,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct Summary {
    pub specs: Vec<SpecResult>,
    /// Ginkgo's closing lines; `None` if the binary stopped before printing them.
    pub suite_line: Option<SuiteLine>,
    pub succeeded: bool,
    /// Why the suite's set-up (BeforeSuite: clients, the MCS CRDs) failed; no
    /// spec ran then.
    pub setup_failure: Option<String>,
    pub label_filter: String,
    pub dry_run: bool,
    /// The folder with the reports ([`JSON_REPORT`], [`JUNIT_REPORT`], the
    /// suite's [`SUITE_HTML_REPORT`] and [`SUITE_YAML_REPORT`], [`LOG`]).
    pub report_dir: PathBuf,
}

impl Summary {
    /// Specs in `state`.
    pub fn in_state(&self, state: SpecState) -> impl Iterator<Item = &SpecResult> {
        self.specs.iter().filter(move |s| s.state == state)
    }

    pub fn spec(&self, name: &str) -> Option<&SpecResult> {
        self.specs.iter().find(|s| s.name == name)
    }
}

impl fmt::Display for Summary {
    /// One line per spec (state, labels, name, reason), then the suite's own
    /// lines: what CI logs show.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "MCS conformance{} (label filter {:?}; reports in {}):",
            if self.dry_run { " dry run" } else { "" },
            self.label_filter,
            self.report_dir.display()
        )?;
        if let Some(failure) = &self.setup_failure {
            writeln!(f, "  set-up failed:")?;
            for line in gist(failure) {
                writeln!(f, "    {line}")?;
            }
        }
        for spec in &self.specs {
            write!(
                f,
                "  {:<7} [{}] {}",
                spec.state,
                spec.labels.join(", "),
                spec.name
            )?;
            match (spec.state, spec.reason()) {
                (SpecState::Failed | SpecState::Skipped, Some(reason)) => {
                    writeln!(f, " — {reason}")?
                }
                _ => writeln!(f)?,
            }
        }
        match &self.suite_line {
            Some(line) => write!(f, "{}", line.text),
            None => write!(f, "(no Ginkgo summary line in the output)"),
        }
    }
}

/// Ginkgo's JSON report: one entry per suite.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SuiteReport {
    #[serde(default)]
    suite_succeeded: bool,
    #[serde(default)]
    suite_config: SuiteConfig,
    #[serde(default)]
    spec_reports: Option<Vec<SpecReport>>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SuiteConfig {
    #[serde(default)]
    label_filter: String,
    #[serde(default)]
    dry_run: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SpecReport {
    container_hierarchy_texts: Option<Vec<String>>,
    container_hierarchy_labels: Option<Vec<Option<Vec<String>>>>,
    leaf_node_type: String,
    #[serde(default)]
    leaf_node_text: String,
    leaf_node_labels: Option<Vec<String>>,
    state: String,
    /// Nanoseconds.
    #[serde(default)]
    run_time: u64,
    failure: Option<Failure>,
    report_entries: Option<Vec<ReportEntry>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Failure {
    #[serde(default)]
    message: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ReportEntry {
    name: String,
    value: Option<ReportValue>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ReportValue {
    #[serde(default)]
    representation: String,
}

/// The summary of a run from Ginkgo's JSON report and the binary's output.
pub fn parse(json: &str, output: &str, report_dir: &Path) -> Result<Summary, String> {
    let suites: Vec<SuiteReport> = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let [suite] = <[SuiteReport; 1]>::try_from(suites)
        .map_err(|s| format!("expected one suite in the report, found {}", s.len()))?;
    let mut specs = Vec::new();
    let mut setup_failure = None;
    for report in suite.spec_reports.unwrap_or_default() {
        let message = report
            .failure
            .map(|f| f.message.trim().to_string())
            .filter(|m| !m.is_empty());
        match report.leaf_node_type.as_str() {
            "It" => {}
            "BeforeSuite" | "SynchronizedBeforeSuite" if report.state != "passed" => {
                setup_failure = message.or(Some(report.state));
                continue;
            }
            _ => continue,
        }
        let name = report
            .container_hierarchy_texts
            .unwrap_or_default()
            .iter()
            .chain([&report.leaf_node_text])
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        let mut labels: Vec<String> = Vec::new();
        let all_labels = report
            .container_hierarchy_labels
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .flatten()
            .chain(report.leaf_node_labels.unwrap_or_default());
        for label in all_labels {
            if !labels.contains(&label) {
                labels.push(label);
            }
        }
        let entry = |wanted: &str| {
            report
                .report_entries
                .iter()
                .flatten()
                .filter(|e| e.name == wanted)
                .filter_map(|e| e.value.as_ref())
                .map(|v| v.representation.trim().to_string())
                .rfind(|v| !v.is_empty())
        };
        let state = SpecState::from_ginkgo(&report.state);
        // The suite notes non-conformance on every failed try of a retried
        // assertion; only a spec that did not pass is non-conformant.
        let non_conformant = (state == SpecState::Failed)
            .then(|| entry("non-conformant"))
            .flatten();
        specs.push(SpecResult {
            name,
            labels,
            state,
            ginkgo_state: report.state,
            message,
            non_conformant,
            spec_ref: entry("spec-ref"),
            run_time: Duration::from_nanos(report.run_time),
        });
    }
    Ok(Summary {
        specs,
        suite_line: parse_suite_line(output),
        succeeded: suite.suite_succeeded,
        setup_failure,
        label_filter: suite.suite_config.label_filter,
        dry_run: suite.suite_config.dry_run,
        report_dir: report_dir.to_path_buf(),
    })
}

/// Ginkgo's last `Ran N of M Specs in …` line and the result line after it.
pub fn parse_suite_line(output: &str) -> Option<SuiteLine> {
    let lines: Vec<&str> = output.lines().map(str::trim).collect();
    let (at, ran_line) = lines
        .iter()
        .enumerate()
        .rev()
        .find(|(_, l)| l.starts_with("Ran ") && l.contains(" Specs in "))?;
    let mut words = ran_line.split_whitespace().skip(1);
    let ran = words.next()?.parse().ok()?;
    let total = match (words.next(), words.next()) {
        (Some("of"), Some(n)) => n.parse().ok()?,
        _ => return None,
    };
    let result = lines[at + 1..].iter().find(|l| !l.is_empty()).copied();
    let tally = result.and_then(parse_tally);
    let text = match result {
        Some(result) => format!("{ran_line}\n{result}"),
        None => ran_line.to_string(),
    };
    Some(SuiteLine {
        text,
        ran,
        total,
        tally,
    })
}

/// `SUCCESS! -- 27 Passed | 0 Failed | 0 Pending | 0 Skipped` (also with
/// `| 1 Flaked` or a reason before ` -- `).
fn parse_tally(line: &str) -> Option<Tally> {
    let (_, counts) = line.rsplit_once(" -- ")?;
    let mut tally = Tally::default();
    let mut seen = 0;
    for part in counts.split('|') {
        let mut words = part.split_whitespace();
        let (Some(n), Some(word)) = (words.next(), words.next()) else {
            continue;
        };
        let Ok(n) = n.parse() else { continue };
        let slot = match word {
            "Passed" => &mut tally.passed,
            "Failed" => &mut tally.failed,
            "Pending" => &mut tally.pending,
            "Skipped" => &mut tally.skipped,
            _ => continue,
        };
        *slot = n;
        seen += 1;
    }
    (seen == 4).then_some(tally)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_carry_every_option_with_absolute_paths() {
        let mut options = RunOptions::new("kc", &["east", "west"], "Required", "out");
        options.skip_verify_eps_managed_by = true;
        options.dns_domain = Some("clusterset.test".into());
        options.project = Some("Strait".into());
        options.timeout = Some(Duration::from_secs(900));
        let args = options.args();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(args[0], format!("-kubeconfig={}", cwd.join("kc").display()));
        for expected in [
            "-contexts=east,west",
            "--ginkgo.label-filter=Required",
            "--ginkgo.v",
            "-skip-verify-eps-managed-by",
            "-dns-domain=clusterset.test",
            "-project=Strait",
            "--ginkgo.timeout=900s",
        ] {
            assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
        }
        assert!(args.contains(&format!(
            "--ginkgo.json-report={}",
            cwd.join("out").join(JSON_REPORT).display()
        )));
        assert!(!args.iter().any(|a| a.starts_with("-organization")));
    }

    #[test]
    fn input_hash_follows_the_suite_and_not_strait_s_readme() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("go.mod"), "module x\n").unwrap();
        std::fs::write(dir.path().join("a.go"), "package x\n").unwrap();
        std::fs::write(dir.path().join("t.gohtml"), "<p>").unwrap();
        let a = input_hash(dir.path()).unwrap();
        std::fs::write(dir.path().join("README.md"), "where it comes from").unwrap();
        std::fs::create_dir(dir.path().join("testdata")).unwrap();
        assert_eq!(a, input_hash(dir.path()).unwrap());
        // report.go embeds its template: a change there is a change of the binary.
        std::fs::write(dir.path().join("t.gohtml"), "<p>changed").unwrap();
        assert_ne!(a, input_hash(dir.path()).unwrap());
    }

    /// Reports the built suite wrote through [`run`] (see the testdata
    /// README): the report with Ginkgo's SpecEvents timeline dropped, and the
    /// output as the run logged it.
    fn fixture(name: &str) -> Summary {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../third_party/mcs-api-conformance/testdata")
            .join(name);
        let json = std::fs::read_to_string(dir.join(JSON_REPORT)).unwrap();
        let log = std::fs::read_to_string(dir.join(LOG)).unwrap();
        parse(&json, &log, &dir).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// `Required` on two real-node clusters with the MCS CRDs and no controller.
    #[test]
    fn required_specs_without_a_controller() {
        let summary = fixture("required");
        assert!(!summary.succeeded && summary.setup_failure.is_none());
        assert_eq!(summary.label_filter, "Required");
        let line = summary.suite_line.as_ref().expect("Ginkgo's summary");
        assert_eq!((line.ran, line.total), (14, 27));
        let tally = line.tally.expect("counts");
        assert_eq!(
            tally,
            Tally {
                passed: 1,
                failed: 13,
                pending: 0,
                skipped: 13
            }
        );
        // The report and the printed counts agree.
        assert_eq!(summary.specs.len(), 27);
        for (state, count) in [
            (SpecState::Passed, tally.passed),
            (SpecState::Failed, tally.failed),
            (SpecState::Skipped, tally.skipped),
        ] {
            assert_eq!(summary.in_state(state).count(), count, "{state}");
        }
        for spec in &summary.specs {
            let expected = if !spec.has_label(REQUIRED) {
                SpecState::Skipped
            } else if spec.name.contains("not exported") {
                // Nothing resolves the clusterset name: trivially inaccessible.
                SpecState::Passed
            } else {
                SpecState::Failed
            };
            assert_eq!(spec.state, expected, "{}", spec.name);
            // Specs that note their KEP section in their body have none when skipped.
            if spec.state != SpecState::Skipped {
                assert!(
                    spec.spec_ref
                        .as_deref()
                        .is_some_and(|r| r.starts_with("https://")),
                    "{} names its KEP section",
                    spec.name
                );
            }
            if spec.state == SpecState::Failed {
                assert!(spec.reason().is_some(), "{} has a reason", spec.name);
                assert!(
                    spec.run_time >= Duration::from_secs(20),
                    "{} waited",
                    spec.name
                );
            }
        }
        let headless = summary
            .spec("Exporting a headless service should create a ServiceImport of type Headless in the service's namespace in each cluster. Unexporting should delete the ServiceImport")
            .expect("by full name");
        assert_eq!(headless.labels, ["Headless", REQUIRED]);
        assert_eq!(
            headless.non_conformant.as_deref(),
            Some("ServiceImport was not found on cluster \"east\"")
        );
        // Without a note, the reason is the failure past Gomega's framing.
        let no_ip = summary
            .spec("No clusterset IP should be allocated for a Headless ServiceImport")
            .expect("by full name");
        assert_eq!(no_ip.non_conformant, None);
        assert!(
            no_ip
                .message
                .as_deref()
                .unwrap()
                .starts_with("Timed out after")
        );
        assert_eq!(
            no_ip.reason(),
            Some("ServiceImport was not found on cluster \"east\"")
        );
        let conflict = summary
            .spec("A ClusterIP service exported on two clusters with conflicting ports should apply the conflict resolution policy and report a Conflict condition on each ServiceExport")
            .expect("container texts joined");
        assert_eq!(conflict.labels, ["ClusterIP", REQUIRED]);
        let shown = summary.to_string();
        assert!(shown.ends_with(&line.text), "{shown}");
        assert!(shown.contains("failed  [ExternalName, Required] Exporting an ExternalName service should set ServiceExport Valid condition to False — The Valid condition was not set to False"), "{shown}");
    }

    /// Contexts whose API servers refuse connections.
    #[test]
    fn unreachable_clusters_fail_the_set_up() {
        let summary = fixture("unreachable");
        assert!(!summary.succeeded && summary.specs.is_empty());
        let failure = summary
            .setup_failure
            .as_deref()
            .expect("BeforeSuite failed");
        assert!(failure.starts_with("Test suite set up failed"), "{failure}");
        let line = summary.suite_line.as_ref().unwrap();
        assert_eq!((line.ran, line.total, line.tally), (0, 27, None));
        assert!(
            line.text
                .ends_with("FAIL! -- A BeforeSuite node failed so all tests were skipped.")
        );
        let shown = summary.to_string();
        for context in ["east", "west"] {
            assert!(
                shown.contains(&format!(
                    "error listing ServiceExports on context {context}: "
                )),
                "{shown}"
            );
        }
        assert!(!shown.contains("0x"), "no value dumps: {shown}");
    }

    /// A label filter that matches no spec fails the run (`--ginkgo.fail-on-empty`).
    #[test]
    fn a_filter_that_selects_nothing_fails() {
        let summary = fixture("no-match");
        assert!(!summary.succeeded && summary.setup_failure.is_none());
        assert_eq!(summary.label_filter, "NoSuchLabel");
        assert_eq!(summary.in_state(SpecState::Skipped).count(), 27);
        let line = summary.suite_line.as_ref().unwrap();
        assert!(line.text.contains("--fail-on-empty"), "{}", line.text);
        assert_eq!(
            line.tally,
            Some(Tally {
                skipped: 27,
                ..Tally::default()
            })
        );
    }

    #[test]
    fn output_without_ginkgo_s_summary_has_no_suite_line() {
        assert_eq!(
            parse_suite_line("flag provided but not defined: -x\nUsage of conformance.test:\n"),
            None
        );
    }

    /// Builds the vendored suite (once per input hash) and walks its specs:
    /// the build works and the parser reads what this very binary writes.
    #[test]
    fn built_suite_dry_run_lists_every_spec_with_its_labels() {
        let binary = ensure_built().unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::tempdir().unwrap();
        let mut options = RunOptions::new("/nonexistent", &["east", "west"], "", dir.path());
        options.dry_run = true;
        let summary = run_with(&binary, &options).unwrap_or_else(|e| panic!("{e}"));
        assert!(summary.dry_run && summary.succeeded && summary.setup_failure.is_none());
        let line = summary.suite_line.as_ref().expect("Ginkgo's summary");
        assert_eq!((line.ran, line.total), (27, 27), "{}", line.text);
        assert_eq!(summary.specs.len(), 27);
        for spec in &summary.specs {
            assert_eq!(spec.state, SpecState::Passed, "{}", spec.name);
            assert!(
                spec.has_label(REQUIRED) != spec.has_label(OPTIONAL),
                "{} is either Required or Optional: {:?}",
                spec.name,
                spec.labels
            );
        }
        assert_eq!(
            summary
                .in_state(SpecState::Passed)
                .filter(|s| s.has_label(REQUIRED))
                .count(),
            14
        );
        let not_exported = summary
            .spec("Connectivity to a service that is not exported should be inaccessible")
            .expect("the spec by its full name");
        assert_eq!(not_exported.labels, [REQUIRED]);
        for file in [
            JSON_REPORT,
            JUNIT_REPORT,
            SUITE_HTML_REPORT,
            SUITE_YAML_REPORT,
            LOG,
        ] {
            assert!(dir.path().join(file).exists(), "{file}");
        }
    }
}

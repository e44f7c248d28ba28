//! `strait identity`: make and inspect the trust anchor and per-cluster issuers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Subcommand, ValueEnum};
use rustls::pki_types::UnixTime;
use strait_mesh::identity::ca::{self, PemPair};
use strait_mesh::identity::certs;

#[derive(Debug, Subcommand)]
pub enum IdentityCommand {
    /// Create a trust anchor (root CA, ECDSA P-256): ca.crt and ca.key in --out-dir.
    /// Keep ca.key offline; only issuers are signed with it.
    TrustAnchor {
        #[arg(long)]
        out_dir: PathBuf,
        /// Validity, e.g. 8760h (one year).
        #[arg(long, default_value = "8760h", value_parser = humantime::parse_duration)]
        validity: Duration,
        #[arg(long, default_value = "strait trust anchor")]
        common_name: String,
    },
    /// Create a cluster's issuer (intermediate CA) signed by the trust anchor.
    Issuer {
        /// Trust-anchor certificate (PEM).
        #[arg(long)]
        anchor_cert: PathBuf,
        /// Trust-anchor private key (PEM).
        #[arg(long)]
        anchor_key: PathBuf,
        /// Cluster this issuer serves (goes into its name).
        #[arg(long)]
        cluster: String,
        /// The trust domain the issuer may certify (X.509 name constraint: a leaked
        /// issuer key cannot mint another cluster's identities); default:
        /// <cluster>.<clusterset-domain>.
        #[arg(long)]
        trust_domain: Option<String>,
        /// Parent of the default per-cluster trust domains.
        #[arg(long, default_value = strait_mesh::names::CLUSTERSET_DOMAIN)]
        clusterset_domain: String,
        /// Validity, e.g. 2160h (90 days). Shorter than the anchor's.
        #[arg(long, default_value = "2160h", value_parser = humantime::parse_duration)]
        validity: Duration,
        /// Write issuer.crt, issuer.key and ca.crt here…
        #[arg(long, conflicts_with = "output")]
        out_dir: Option<PathBuf>,
        /// …or print a Kubernetes Secret for the issuer service.
        #[arg(short, long, value_enum)]
        output: Option<Format>,
        /// Namespace of the Secret.
        #[arg(long, default_value = "strait-system")]
        namespace: String,
        /// Trust-anchor bundle to ship as ca.crt (several roots during a rotation);
        /// default: the anchor certificate alone.
        #[arg(long)]
        trust_anchors: Option<PathBuf>,
    },
    /// Move a cluster's trust anchors (and issuer) one step along a rotation, refusing
    /// steps that would break mTLS: old+new, then new+old with --issuer-dir, then new.
    Rotate(crate::rotate::RotateArgs),
    /// Show subject, SANs, validity and chain of the certificates in a PEM file.
    Inspect { file: PathBuf },
    /// Check that an issuer can sign: a CA, key matches, valid now, signed by an anchor.
    Verify {
        #[arg(long)]
        issuer_cert: PathBuf,
        #[arg(long)]
        issuer_key: PathBuf,
        #[arg(long)]
        trust_anchors: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    Yaml,
    Json,
}

fn read(path: &Path, what: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("read the {what} from {}", path.display()))
}

fn write(dir: &Path, name: &str, contents: &str, secret: bool) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join(name);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&path)
        .with_context(|| format!("write {}", path.display()))?;
    file.write_all(contents.as_bytes())?;
    Ok(path)
}

pub fn run(command: IdentityCommand) -> anyhow::Result<()> {
    match command {
        IdentityCommand::TrustAnchor {
            out_dir,
            validity,
            common_name,
        } => {
            let anchor = ca::new_trust_anchor(&common_name, validity)?;
            let cert = write(&out_dir, "ca.crt", &anchor.cert_pem, false)?;
            let key = write(&out_dir, "ca.key", &anchor.key_pem, true)?;
            eprintln!(
                "trust anchor: {}\nkey (keep offline): {}",
                cert.display(),
                key.display()
            );
            Ok(())
        }
        IdentityCommand::Issuer {
            anchor_cert,
            anchor_key,
            cluster,
            trust_domain,
            clusterset_domain,
            validity,
            out_dir,
            output,
            namespace,
            trust_anchors,
        } => {
            let trust_domain = trust_domain.unwrap_or_else(|| {
                strait_mesh::names::cluster_trust_domain(&cluster, &clusterset_domain)
            });
            let anchor = PemPair {
                cert_pem: read(&anchor_cert, "anchor certificate")?,
                key_pem: read(&anchor_key, "anchor key")?,
            };
            let issuer = ca::new_issuer(&anchor, &cluster, Some(&trust_domain), validity)
                .context("refusing to make the issuer")?;
            let bundle = match &trust_anchors {
                Some(path) => read(path, "trust-anchor bundle")?,
                None => anchor.cert_pem.clone(),
            };
            // The bundle shipped must verify the issuer, or every workload would fail later.
            certs::validate_issuer(
                "new issuer",
                &certs::parse_certs("issuer", issuer.cert_pem.as_bytes())?[0],
                &issuer.key_pem,
                &certs::parse_certs("trust-anchor bundle", bundle.as_bytes())?,
                UnixTime::now(),
            )
            .context(
                "the --trust-anchors bundle does not contain the anchor that signed this issuer",
            )?;
            match (out_dir, output) {
                (Some(dir), None) => {
                    write(&dir, "issuer.crt", &issuer.cert_pem, false)?;
                    write(&dir, "issuer.key", &issuer.key_pem, true)?;
                    write(&dir, "ca.crt", &bundle, false)?;
                    eprintln!(
                        "issuer for {cluster} (trust domain {trust_domain}): {}/issuer.crt, issuer.key, ca.crt",
                        dir.display()
                    );
                }
                (None, Some(format)) => {
                    print!("{}", issuer_secret(&issuer, &bundle, &namespace, format)?)
                }
                _ => {
                    bail!("say where the issuer goes: --out-dir DIR, or -o yaml|json for a Secret")
                }
            }
            Ok(())
        }
        IdentityCommand::Rotate(args) => {
            print!(
                "{}",
                crate::runtime()?.block_on(crate::rotate::rotate(args))?
            );
            Ok(())
        }
        IdentityCommand::Inspect { file } => {
            print!("{}", inspect(&read(&file, "certificate file")?)?);
            Ok(())
        }
        IdentityCommand::Verify {
            issuer_cert,
            issuer_key,
            trust_anchors,
        } => {
            let cert = read(&issuer_cert, "issuer certificate")?;
            let key = read(&issuer_key, "issuer key")?;
            let anchors = certs::parse_certs(
                "trust-anchor bundle",
                read(&trust_anchors, "trust-anchor bundle")?.as_bytes(),
            )?;
            let der = &certs::parse_certs("issuer certificate", cert.as_bytes())?[0];
            certs::validate_issuer("issuer certificate", der, &key, &anchors, UnixTime::now())?;
            println!(
                "ok: {} can issue under this trust-anchor bundle",
                issuer_cert.display()
            );
            Ok(())
        }
    }
}

/// The Secret the issuer service mounts (`tls.crt`, `tls.key`, `ca.crt`).
fn issuer_secret(
    issuer: &PemPair,
    bundle: &str,
    namespace: &str,
    format: Format,
) -> anyhow::Result<String> {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let secret = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": "strait-identity-issuer",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "strait", "app.kubernetes.io/component": "identity"},
        },
        "data": {"tls.crt": b64(&issuer.cert_pem), "tls.key": b64(&issuer.key_pem), "ca.crt": b64(bundle)},
    });
    Ok(match format {
        Format::Yaml => serde_yaml::to_string(&secret)?,
        Format::Json => serde_json::to_string_pretty(&secret)? + "\n",
    })
}

/// A human-readable report of every certificate in a PEM text and how they chain.
pub fn inspect(pem: &str) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let ders = certs::parse_certs("file", pem.as_bytes())?;
    let infos = ders
        .iter()
        .enumerate()
        .map(|(i, d)| certs::inspect(&format!("certificate #{}", i + 1), d))
        .collect::<Result<Vec<_>, _>>()?;
    let now = UnixTime::now().as_secs() as i64;
    let mut out = String::new();
    for (i, info) in infos.iter().enumerate() {
        let state = if now < info.not_before_unix {
            "NOT YET VALID"
        } else if now > info.not_after_unix {
            "EXPIRED"
        } else {
            "valid"
        };
        let kind = match (info.is_ca, info.self_signed) {
            (true, true) => "root CA (trust anchor)",
            (true, false) => "intermediate CA (issuer)",
            (false, _) => "leaf",
        };
        writeln!(out, "certificate #{} — {kind}", i + 1)?;
        writeln!(
            out,
            "  subject:   {}",
            if info.subject.is_empty() {
                "(empty)"
            } else {
                &info.subject
            }
        )?;
        writeln!(out, "  issuer:    {}", info.issuer)?;
        writeln!(out, "  serial:    {}", info.serial)?;
        if let Some(id) = &info.spiffe_id {
            writeln!(out, "  identity:  {id}")?;
        }
        if !info.sans.is_empty() {
            writeln!(out, "  SANs:      {}", info.sans.join(", "))?;
        }
        writeln!(
            out,
            "  validity:  {} → {} ({state})",
            info.not_before, info.not_after
        )?;
        // Chain: which certificate in this file signed this one.
        let signer = infos
            .iter()
            .position(|other| other.subject == info.issuer && other.is_ca);
        match signer {
            Some(j) if j == i => writeln!(out, "  chain:     self-signed")?,
            Some(j) => writeln!(out, "  chain:     signed by certificate #{}", j + 1)?,
            None => writeln!(out, "  chain:     issuer not in this file")?,
        }
    }
    Ok(out)
}

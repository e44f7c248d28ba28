//! The certificates and keys one test cluster needs, made fresh for each cluster
//! with rcgen: a cluster CA, the API server's serving certificate, client
//! certificates for the admin and the controller manager, and the
//! service-account signing key.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A PEM certificate with its PEM private key.
#[derive(Clone, Debug)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Everything a cluster's components need to authenticate each other.
#[derive(Debug)]
pub struct ClusterPki {
    pub ca: CertPair,
    /// The CA as a signer, for client certificates made later (kubelets,
    /// kube-proxy, the scheduler and CoreDNS of real-node clusters).
    ca_issuer: Issuer<'static, KeyPair>,
    pub apiserver: CertPair,
    pub admin: CertPair,
    pub controller_manager: CertPair,
    /// ECDSA P-256 key the API server signs service-account tokens with.
    pub service_account_key_pem: String,
    /// Its public half, which verifies them.
    pub service_account_pub_pem: String,
}

/// Paths of the PKI once written to a cluster's folder.
#[derive(Clone, Debug)]
pub struct PkiFiles {
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub apiserver_cert: PathBuf,
    pub apiserver_key: PathBuf,
    pub service_account_key: PathBuf,
    pub service_account_pub: PathBuf,
}

fn dn(common_name: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(o) = organization {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    common_name: &str,
    organization: Option<&str>,
    sans: Vec<SanType>,
    usage: ExtendedKeyUsagePurpose,
) -> Result<CertPair, rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(common_name, organization);
    params.subject_alt_names = sans;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, issuer)?;
    Ok(CertPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

impl ClusterPki {
    /// Makes a fresh PKI for the cluster `name` whose API server answers on
    /// `apiserver_ips` (plus `localhost` and the in-cluster service names).
    pub fn generate(name: &str, apiserver_ips: &[IpAddr]) -> Result<Self, rcgen::Error> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::default();
        ca_params.distinguished_name = dn(&format!("strait-testenv-{name}-ca"), None);
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key_pem = ca_key.serialize_pem();
        let ca = CertifiedIssuer::self_signed(ca_params.clone(), ca_key)?;
        let ca_issuer = Issuer::new(ca_params, KeyPair::from_pem(&ca_key_pem)?);

        let mut sans: Vec<SanType> = apiserver_ips
            .iter()
            .map(|ip| SanType::IpAddress(*ip))
            .collect();
        for dns in [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ] {
            sans.push(SanType::DnsName(dns.try_into()?));
        }
        let apiserver = leaf(
            &ca,
            "kube-apiserver",
            None,
            sans,
            ExtendedKeyUsagePurpose::ServerAuth,
        )?;
        // system:masters is bound to cluster-admin by RBAC's bootstrap policy.
        let admin = leaf(
            &ca,
            "strait-testenv-admin",
            Some("system:masters"),
            vec![],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        // The bootstrap policy grants this user exactly what the controller manager needs.
        let controller_manager = leaf(
            &ca,
            "system:kube-controller-manager",
            None,
            vec![],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let sa_key = KeyPair::generate()?;
        Ok(Self {
            ca: CertPair {
                cert_pem: ca.pem(),
                key_pem: ca_key_pem,
            },
            ca_issuer,
            apiserver,
            admin,
            controller_manager,
            service_account_key_pem: sa_key.serialize_pem(),
            service_account_pub_pem: sa_key.public_key_pem(),
        })
    }

    /// A client certificate for user `common_name` in group `organization`,
    /// signed by the cluster CA (e.g. `system:node:<name>` in `system:nodes`).
    pub fn client_cert(
        &self,
        common_name: &str,
        organization: Option<&str>,
    ) -> Result<CertPair, rcgen::Error> {
        leaf(
            &self.ca_issuer,
            common_name,
            organization,
            vec![],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// Writes the files the components read (keys mode 0600) into `dir`.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<PkiFiles> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)?;
        let write = |name: &str, contents: &str, secret: bool| -> std::io::Result<PathBuf> {
            let path = dir.join(name);
            std::fs::write(&path, contents)?;
            if secret {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            }
            Ok(path)
        };
        Ok(PkiFiles {
            ca_cert: write("ca.crt", &self.ca.cert_pem, false)?,
            ca_key: write("ca.key", &self.ca.key_pem, true)?,
            apiserver_cert: write("apiserver.crt", &self.apiserver.cert_pem, false)?,
            apiserver_key: write("apiserver.key", &self.apiserver.key_pem, true)?,
            service_account_key: write("sa.key", &self.service_account_key_pem, true)?,
            service_account_pub: write("sa.pub", &self.service_account_pub_pem, false)?,
        })
    }
}

//! Where kproxy reaches the API server, and with which credentials: one decision for the agent,
//! `kproxy dump diff` and `kproxy doctor`, so that doctor checks the endpoint the agent uses.
//!
//! The URL, first match wins (kube-proxy's `--master` over its kubeconfig; Cilium's
//! `k8sServiceHost`/`k8sServicePort` and Calico's `kubernetes-services-endpoint` ConfigMap for the
//! explicit endpoint):
//! 1. `--master URL`;
//! 2. `--api-server-host HOST [--api-server-port PORT]`, else the environment's
//!    `KPROXY_API_SERVER_HOST` [`KPROXY_API_SERVER_PORT`] (the DaemonSet sets them from the optional
//!    ConfigMap `kproxy-api-endpoint`): `https://HOST:PORT`, port 6443 (kubeadm's) by default. Each
//!    pair goes together: a host from the command line takes its port from the command line;
//! 3. the kubeconfig's server (`--kubeconfig`, or `clientConnection.kubeconfig` of `--config`);
//! 4. in a pod, `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`, which the kubelet sets to the
//!    `kubernetes` Service's ClusterIP: it answers only while something on this node translates
//!    ClusterIPs, which on a node without kube-proxy is kproxy itself, once it has synced;
//! 5. outside a pod, `$KUBECONFIG` or `~/.kube/config`.
//!
//! The credentials: the kubeconfig's when one is given; else, for 2 and 4, the pod's service account
//! (`token`, `ca.crt` and `namespace` in `/var/run/secrets/kubernetes.io/serviceaccount`, or in the
//! directory `KPROXY_SERVICE_ACCOUNT_DIR` names), the way client-go's in-cluster config uses them,
//! the token re-read as the kubelet rotates it; `--master` alone carries none, as in kube-proxy.
//!
//! TLS: the server's certificate is verified against the cluster CA and the URL's host, as client-go
//! does when `KUBERNETES_SERVICE_HOST` is overridden (Calico's ConfigMap): the name or address given
//! must be in the certificate. kubeadm puts `controlPlaneEndpoint`, each API server's advertise
//! address, the `kubernetes` Service's ClusterIP and `kubernetes.default.svc` in it
//! (`apiServer.certSANs` adds more); a kubeconfig may name another with `tls-server-name`.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use kube::Client;

/// The explicit endpoint's environment variables (the DaemonSet fills them from ConfigMap
/// [`ENDPOINT_CONFIG_MAP`]).
pub const API_SERVER_HOST_ENV: &str = "KPROXY_API_SERVER_HOST";
pub const API_SERVER_PORT_ENV: &str = "KPROXY_API_SERVER_PORT";
/// The port of an explicit host given without one: the API server's own (kubeadm's), not the
/// `kubernetes` Service's 443.
pub const DEFAULT_API_SERVER_PORT: u16 = 6443;
/// The optional ConfigMap of deploy/ (keys `host` and `port`) in kproxy's namespace.
pub const ENDPOINT_CONFIG_MAP: &str = "kproxy-api-endpoint";
/// What the kubelet sets in every pod: the `kubernetes` Service's ClusterIP and port.
pub const IN_CLUSTER_HOST_ENV: &str = "KUBERNETES_SERVICE_HOST";
pub const IN_CLUSTER_PORT_ENV: &str = "KUBERNETES_SERVICE_PORT";
/// Where the kubelet mounts the service account's token, CA and namespace.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Another directory holding them (a token mounted elsewhere, or a test's).
pub const SERVICE_ACCOUNT_DIR_ENV: &str = "KPROXY_SERVICE_ACCOUNT_DIR";

/// How to reach the API server, as the command line says it.
#[derive(Clone, Debug, Default)]
pub struct KubeOptions {
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
    /// `--api-server-host`: the API server itself, for nodes where nothing translates ClusterIPs.
    pub api_server_host: Option<String>,
    /// `--api-server-port`.
    pub api_server_port: Option<u16>,
}

/// Why the URL is the one used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Master,
    /// `--api-server-host`/`--api-server-port`.
    ApiServerFlags,
    /// `KPROXY_API_SERVER_HOST`/`KPROXY_API_SERVER_PORT`.
    ApiServerEnv,
    /// The server a kubeconfig names.
    Kubeconfig(PathBuf),
    /// `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`: the `kubernetes` Service's ClusterIP.
    InCluster,
    /// `$KUBECONFIG` or `~/.kube/config`, outside a pod.
    LocalKubeconfig,
}

impl Origin {
    /// What the operator set (or did not), as the log and doctor name it.
    pub fn describe(&self) -> String {
        match self {
            Origin::Master => "--master".to_owned(),
            Origin::ApiServerFlags => "--api-server-host/--api-server-port".to_owned(),
            Origin::ApiServerEnv => {
                format!(
                    "{API_SERVER_HOST_ENV}/{API_SERVER_PORT_ENV}, set from ConfigMap {ENDPOINT_CONFIG_MAP}"
                )
            }
            Origin::Kubeconfig(path) => format!("the server of kubeconfig {}", path.display()),
            Origin::InCluster => format!(
                "in-cluster {IN_CLUSTER_HOST_ENV}/{IN_CLUSTER_PORT_ENV}, the `kubernetes` Service's ClusterIP"
            ),
            Origin::LocalKubeconfig => "$KUBECONFIG or ~/.kube/config (not in a pod)".to_owned(),
        }
    }
}

/// Whose credentials go with the requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    Kubeconfig(PathBuf),
    /// The pod's service account: the directory holding `token`, `ca.crt` and `namespace`.
    ServiceAccount(PathBuf),
    LocalKubeconfig,
    /// `--master` without a kubeconfig: plain requests, as kube-proxy sends them.
    None,
}

impl Credentials {
    pub fn describe(&self) -> String {
        match self {
            Credentials::Kubeconfig(path) => format!("kubeconfig {}", path.display()),
            Credentials::ServiceAccount(dir) => {
                format!("the service account's token and CA in {}", dir.display())
            }
            Credentials::LocalKubeconfig => "$KUBECONFIG or ~/.kube/config".to_owned(),
            Credentials::None => "none".to_owned(),
        }
    }
}

/// The decision, before any file is read: the URL (`None`: the kubeconfig's own) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub url: Option<String>,
    pub origin: Origin,
    pub credentials: Credentials,
    /// An explicit endpoint that `--master` overrides, to say so.
    pub overridden: Option<Origin>,
}

/// The endpoint in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub origin: Origin,
    pub credentials: Credentials,
    pub overridden: Option<Origin>,
}

impl Endpoint {
    /// The in-cluster ClusterIP: the one endpoint a node without a service proxy cannot reach.
    pub fn through_cluster_ip(&self) -> bool {
        self.origin == Origin::InCluster
    }

    /// What an operator must know about this endpoint, if anything.
    pub fn caveat(&self) -> Option<String> {
        self.through_cluster_ip().then(|| {
            format!(
                "a ClusterIP answers only while something on this node translates ClusterIPs (kube-proxy, or \
                 this agent once it has synced); on a node without a service proxy set \
                 --api-server-host/--api-server-port or ConfigMap {ENDPOINT_CONFIG_MAP}"
            )
        })
    }

    /// `https://10.0.0.1:6443 (from --api-server-host/--api-server-port)`, for the log and doctor.
    pub fn describe(&self) -> String {
        let mut text = format!("{} (from {}", self.url, self.origin.describe());
        if let Some(overridden) = &self.overridden {
            text.push_str(&format!("; {} is set but --master wins", overridden.describe()));
        }
        text.push(')');
        text
    }
}

/// The environment, read once per lookup; an empty value counts as unset (a ConfigMap key left "").
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// Decides the URL and the credentials (see the module docs); `env` looks up the environment.
pub fn plan(options: &KubeOptions, env: &dyn Fn(&str) -> Option<String>) -> Result<Plan> {
    let explicit = explicit_endpoint(options, env)?;
    let in_pod = env(IN_CLUSTER_HOST_ENV).is_some();
    let service_account = || {
        Credentials::ServiceAccount(
            env(SERVICE_ACCOUNT_DIR_ENV).map_or_else(|| PathBuf::from(SERVICE_ACCOUNT_DIR), PathBuf::from),
        )
    };
    let credentials = match (&options.kubeconfig, &options.master) {
        (Some(path), _) => Credentials::Kubeconfig(path.clone()),
        (None, Some(_)) => Credentials::None,
        (None, None) if explicit.is_some() || in_pod => service_account(),
        (None, None) => Credentials::LocalKubeconfig,
    };
    if let Some(master) = &options.master {
        return Ok(Plan {
            url: Some(master.clone()),
            origin: Origin::Master,
            credentials,
            overridden: explicit.map(|(_, origin)| origin),
        });
    }
    let (url, origin) = match (explicit, &options.kubeconfig) {
        (Some((url, origin)), _) => (Some(url), origin),
        (None, Some(path)) => (None, Origin::Kubeconfig(path.clone())),
        (None, None) if in_pod => (Some(in_cluster_url(env)?), Origin::InCluster),
        (None, None) => (None, Origin::LocalKubeconfig),
    };
    Ok(Plan { url, origin, credentials, overridden: None })
}

/// `--api-server-host`/`--api-server-port`, else their environment variables, as a URL.
fn explicit_endpoint(
    options: &KubeOptions,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(String, Origin)>> {
    let flag_host = options.api_server_host.as_deref().map(str::trim).filter(|h| !h.is_empty());
    let (host, port, origin) = match (flag_host, env(API_SERVER_HOST_ENV)) {
        (Some(host), _) => (host.to_owned(), options.api_server_port, Origin::ApiServerFlags),
        (None, Some(host)) => {
            let port = match (options.api_server_port, env(API_SERVER_PORT_ENV)) {
                (Some(port), _) => Some(port),
                (None, Some(text)) => Some(text.parse::<u16>().ok().filter(|p| *p != 0).with_context(|| {
                    format!("{API_SERVER_PORT_ENV}={text:?} is not a port (ConfigMap {ENDPOINT_CONFIG_MAP}, key port)")
                })?),
                (None, None) => None,
            };
            (host, port, Origin::ApiServerEnv)
        }
        (None, None) if options.api_server_port.is_some() => {
            bail!("--api-server-port needs --api-server-host (or {API_SERVER_HOST_ENV})")
        }
        (None, None) => return Ok(None),
    };
    let port = port.unwrap_or(DEFAULT_API_SERVER_PORT);
    if port == 0 {
        bail!("--api-server-port 0 is not a port");
    }
    Ok(Some((https_url(&host, port, &origin)?, origin)))
}

/// `https://HOST:PORT`, with an IPv6 address in brackets.
fn https_url(host: &str, port: u16, origin: &Origin) -> Result<String> {
    if host.contains("://") || host.contains('/') {
        bail!(
            "{} takes a host name or an address, not a URL: {host:?} (--master takes a URL)",
            origin.describe()
        );
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let url = match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => format!("https://{}", std::net::SocketAddr::new(ip, port)),
        Err(_) if host.contains(':') => {
            bail!("{}: {host:?} is not a host name or an address (give the port apart)", origin.describe())
        }
        Err(_) => format!("https://{host}:{port}"),
    };
    url.parse::<hyper::Uri>().with_context(|| format!("{}: {url:?} is not a URL", origin.describe()))?;
    Ok(url)
}

/// client-go's in-cluster URL: both variables, or none.
fn in_cluster_url(env: &dyn Fn(&str) -> Option<String>) -> Result<String> {
    let host = env(IN_CLUSTER_HOST_ENV).unwrap_or_default();
    let port = env(IN_CLUSTER_PORT_ENV)
        .with_context(|| format!("{IN_CLUSTER_HOST_ENV} is set but {IN_CLUSTER_PORT_ENV} is not"))?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .with_context(|| format!("{IN_CLUSTER_PORT_ENV}={port:?} is not a port"))?;
    https_url(&host, port, &Origin::InCluster)
}

/// The client configuration of [`plan`] with the process environment.
pub async fn config(options: &KubeOptions) -> Result<(kube::Config, Endpoint)> {
    config_with(options, &process_env).await
}

/// The client configuration of [`plan`], with `env` as the environment.
pub async fn config_with(
    options: &KubeOptions,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(kube::Config, Endpoint)> {
    let plan = plan(options, env)?;
    let mut config = match &plan.credentials {
        Credentials::Kubeconfig(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("--kubeconfig {}", path.display()))?
        }
        Credentials::None => kube::Config::new("http://localhost".parse().expect("a valid URI")),
        Credentials::ServiceAccount(dir) => {
            let url = plan.url.as_deref().expect("a URL with service-account credentials");
            service_account_config(dir, url).await?
        }
        Credentials::LocalKubeconfig => {
            kube::Config::from_kubeconfig(&Default::default()).await.with_context(|| {
                format!(
                    "no --kubeconfig, --master or --api-server-host, not in a pod ({IN_CLUSTER_HOST_ENV} unset), \
                     and no usable $KUBECONFIG or ~/.kube/config"
                )
            })?
        }
    };
    if let Some(url) = &plan.url {
        config.cluster_url =
            url.parse().with_context(|| format!("{} {url:?} is not a URL", plan.origin.describe()))?;
    }
    let url = config.cluster_url.to_string().trim_end_matches('/').to_owned();
    let endpoint =
        Endpoint { url, origin: plan.origin, credentials: plan.credentials, overridden: plan.overridden };
    Ok((config, endpoint))
}

/// The service account's token and CA for `url`, as client-go's in-cluster config takes them: the
/// same credentials a kubeconfig naming the files (`tokenFile`, `certificate-authority`) would give,
/// with the CA re-read when it rotates.
async fn service_account_config(dir: &Path, url: &str) -> Result<kube::Config> {
    let (token, ca) = (dir.join("token"), dir.join("ca.crt"));
    for (file, what) in [(&token, "token"), (&ca, "CA certificate")] {
        if !file.is_file() {
            bail!(
                "{}: no service-account {what} (outside a pod, or automountServiceAccountToken: false; \
                 {SERVICE_ACCOUNT_DIR_ENV} names another directory); give --kubeconfig",
                file.display()
            );
        }
    }
    let namespace = std::fs::read_to_string(dir.join("namespace"))
        .map(|ns| ns.trim().to_owned())
        .ok()
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| "default".to_owned());
    let kubeconfig: kube::config::Kubeconfig = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": {"server": url, "certificate-authority": ca}}],
        "users": [{"name": "service-account", "user": {"tokenFile": token}}],
        "contexts": [{
            "name": "in-cluster",
            "context": {"cluster": "in-cluster", "user": "service-account", "namespace": namespace},
        }],
        "current-context": "in-cluster",
    }))
    .context("the service account's kubeconfig")?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .with_context(|| format!("the service account in {}", dir.display()))?;
    config.root_cert_file = Some(ca);
    Ok(config)
}

/// A client for the endpoint of [`plan`]; logs which endpoint and why.
pub async fn client(options: &KubeOptions) -> Result<Client> {
    let (config, endpoint) = config(options).await?;
    tracing::info!(
        url = %endpoint.url,
        from = %endpoint.origin.describe(),
        credentials = %endpoint.credentials.describe(),
        overridden = endpoint.overridden.as_ref().map(Origin::describe),
        caveat = endpoint.caveat(),
        "API server endpoint"
    );
    Client::try_from(config).context("building the Kubernetes client")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// A CA certificate (EC P-256, self-signed) for the service-account directory.
    const TEST_CA: &str = "\
-----BEGIN CERTIFICATE-----
MIIBiTCCAS+gAwIBAgIUGcUo4CP6ZfR2RJK2GYsynmC0MSQwCgYIKoZIzj0EAwIw
GTEXMBUGA1UEAwwOa3Byb3h5LXRlc3QtY2EwIBcNMjYxMjAxMTQyODAwWhgPMjEy
NjExMDcxNDI4MDBaMBkxFzAVBgNVBAMMDmtwcm94eS10ZXN0LWNhMFkwEwYHKoZI
zj0CAQYIKoZIzj0DAQcDQgAE9KUJtpruP4c8/pW2SKTFTjidrn4gRlU0DBu8M295
g1HglHxYI72Q9PlXXvWl/0qPMakZm4dOMBtQffVCeHlMhKNTMFEwHQYDVR0OBBYE
FLmSuY+uOJKwom5zCSX1oBW1RmOQMB8GA1UdIwQYMBaAFLmSuY+uOJKwom5zCSX1
oBW1RmOQMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSAAwRQIgYaSGQJ3H
hnBv2KhOLpY1A9KVLLpypIFpGEi5zeofnncCIQCUNtAs542kIgElLyFCvYfHhB2z
1Qnx8mRmrEv5tie+AA==
-----END CERTIFICATE-----
";

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let vars: BTreeMap<String, String> =
            vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |name| vars.get(name).cloned().filter(|v| !v.is_empty())
    }

    fn options(
        kubeconfig: Option<&str>,
        master: Option<&str>,
        host: Option<&str>,
        port: Option<u16>,
    ) -> KubeOptions {
        KubeOptions {
            kubeconfig: kubeconfig.map(PathBuf::from),
            master: master.map(str::to_owned),
            api_server_host: host.map(str::to_owned),
            api_server_port: port,
        }
    }

    const IN_POD: [(&str, &str); 2] = [(IN_CLUSTER_HOST_ENV, "10.96.0.1"), (IN_CLUSTER_PORT_ENV, "443")];

    fn url_and_origin(options: &KubeOptions, env: &[(&str, &str)]) -> (Option<String>, Origin) {
        let plan = plan(options, &env_of(env)).unwrap();
        (plan.url, plan.origin)
    }

    #[test]
    fn master_wins_over_the_explicit_endpoint_which_wins_over_the_kubeconfig_and_in_cluster() {
        let all = [IN_POD[0], IN_POD[1], (API_SERVER_HOST_ENV, "10.0.0.9"), (API_SERVER_PORT_ENV, "7443")];
        let everything =
            options(Some("/k.conf"), Some("http://127.0.0.1:8080"), Some("cp.example"), Some(6444));
        let plan = plan(&everything, &env_of(&all)).unwrap();
        assert_eq!((plan.url.as_deref(), &plan.origin), (Some("http://127.0.0.1:8080"), &Origin::Master));
        assert_eq!(plan.overridden, Some(Origin::ApiServerFlags));
        assert_eq!(plan.credentials, Credentials::Kubeconfig("/k.conf".into()));

        let no_master = options(Some("/k.conf"), None, Some("cp.example"), Some(6444));
        assert_eq!(
            url_and_origin(&no_master, &all),
            (Some("https://cp.example:6444".into()), Origin::ApiServerFlags)
        );
        // The flag's host goes with the flag's port (6443 without one), not the environment's.
        let host_only = options(None, None, Some("cp.example"), None);
        assert_eq!(
            url_and_origin(&host_only, &all),
            (Some("https://cp.example:6443".into()), Origin::ApiServerFlags)
        );
        // The environment's pair (the ConfigMap) when no flag is given.
        let kubeconfig_only = options(Some("/k.conf"), None, None, None);
        assert_eq!(
            url_and_origin(&kubeconfig_only, &all),
            (Some("https://10.0.0.9:7443".into()), Origin::ApiServerEnv)
        );
        // Then the kubeconfig's own server, then in-cluster, then ~/.kube/config.
        assert_eq!(url_and_origin(&kubeconfig_only, &IN_POD), (None, Origin::Kubeconfig("/k.conf".into())));
        let none = KubeOptions::default();
        assert_eq!(url_and_origin(&none, &IN_POD), (Some("https://10.96.0.1:443".into()), Origin::InCluster));
        assert_eq!(url_and_origin(&none, &[]), (None, Origin::LocalKubeconfig));
    }

    #[test]
    fn the_explicit_endpoint_takes_the_service_account_unless_a_kubeconfig_is_given() {
        let env = env_of(&[(API_SERVER_HOST_ENV, "10.0.0.1")]);
        let plan_of = |o: &KubeOptions| plan(o, &env).unwrap().credentials;
        assert_eq!(plan_of(&KubeOptions::default()), Credentials::ServiceAccount(SERVICE_ACCOUNT_DIR.into()));
        assert_eq!(plan_of(&options(Some("/k"), None, None, None)), Credentials::Kubeconfig("/k".into()));
        // --master alone sends no credentials, as kube-proxy's.
        assert_eq!(plan_of(&options(None, Some("http://x"), None, None)), Credentials::None);
        let moved = env_of(&[IN_POD[0], IN_POD[1], (SERVICE_ACCOUNT_DIR_ENV, "/run/sa")]);
        assert_eq!(
            plan(&KubeOptions::default(), &moved).unwrap().credentials,
            Credentials::ServiceAccount("/run/sa".into())
        );
    }

    #[test]
    fn endpoint_urls_are_https_with_the_port_and_ipv6_in_brackets() {
        let url = |host: &str, port| https_url(host, port, &Origin::ApiServerFlags);
        assert_eq!(url("10.0.0.1", 6443).unwrap(), "https://10.0.0.1:6443");
        assert_eq!(url("fd00::1", 443).unwrap(), "https://[fd00::1]:443");
        assert_eq!(url("[fd00::1]", 6443).unwrap(), "https://[fd00::1]:6443");
        assert_eq!(url("cp.example.com", 443).unwrap(), "https://cp.example.com:443");
        let error = url("https://cp:6443", 6443).unwrap_err().to_string();
        assert!(error.contains("not a URL") && error.contains("--master"), "{error}");
        assert!(url("cp:6443", 6443).unwrap_err().to_string().contains("give the port apart"));
    }

    #[test]
    fn bad_ports_and_half_settings_are_refused_with_their_name() {
        let error = |o: &KubeOptions, env: &[(&str, &str)]| plan(o, &env_of(env)).unwrap_err().to_string();
        let port_only = options(None, None, None, Some(6443));
        assert!(error(&port_only, &[]).contains("--api-server-port needs --api-server-host"));
        let bad_port = [(API_SERVER_HOST_ENV, "10.0.0.1"), (API_SERVER_PORT_ENV, "https")];
        let message = error(&KubeOptions::default(), &bad_port);
        assert!(message.contains(API_SERVER_PORT_ENV) && message.contains(ENDPOINT_CONFIG_MAP), "{message}");
        assert!(error(&options(None, None, Some("10.0.0.1"), Some(0)), &[]).contains("not a port"));
        let half_in_cluster = [(IN_CLUSTER_HOST_ENV, "10.96.0.1")];
        assert!(error(&KubeOptions::default(), &half_in_cluster).contains(IN_CLUSTER_PORT_ENV));
        // An empty ConfigMap value is no setting at all.
        let empty = [(API_SERVER_HOST_ENV, ""), IN_POD[0], IN_POD[1]];
        assert_eq!(plan(&KubeOptions::default(), &env_of(&empty)).unwrap().origin, Origin::InCluster);
    }

    struct TempDir(PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn service_account_dir(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("kproxy-sa-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), "the-token\n").unwrap();
        std::fs::write(dir.join("ca.crt"), TEST_CA).unwrap();
        std::fs::write(dir.join("namespace"), "kproxy-system").unwrap();
        TempDir(dir)
    }

    /// The explicit endpoint with the pod's credentials: the URL changes, the token file (re-read
    /// on rotation), the CA (re-read too) and the namespace are the service account's.
    #[tokio::test]
    async fn the_explicit_endpoint_keeps_the_service_accounts_token_and_ca() {
        let sa = service_account_dir("explicit");
        let dir = sa.0.display().to_string();
        let env = env_of(&[IN_POD[0], IN_POD[1], (SERVICE_ACCOUNT_DIR_ENV, &dir)]);
        let (config, endpoint) =
            config_with(&options(None, None, Some("10.0.0.1"), Some(6443)), &env).await.unwrap();
        assert_eq!(config.cluster_url.to_string(), "https://10.0.0.1:6443/");
        assert_eq!(endpoint.url, "https://10.0.0.1:6443");
        assert!(!endpoint.through_cluster_ip());
        assert!(endpoint.describe().contains("--api-server-host"), "{}", endpoint.describe());
        assert_eq!(endpoint.caveat(), None);
        assert_eq!(config.auth_info.token_file.as_deref(), Some(sa.0.join("token").to_str().unwrap()));
        assert_eq!(config.root_cert.as_ref().map(Vec::len), Some(1), "the CA certificate, parsed");
        assert_eq!(config.root_cert_file.as_deref(), Some(sa.0.join("ca.crt").as_path()));
        assert_eq!(config.default_namespace, "kproxy-system");
        // No name override: the certificate must name the host given.
        assert_eq!(config.tls_server_name, None);
        assert!(!config.accept_invalid_certs);
        kube::Client::try_from(config).expect("a client with the token and the CA");

        // In-cluster, the same credentials on the ClusterIP, and the log says what that means.
        let (config, endpoint) = config_with(&KubeOptions::default(), &env).await.unwrap();
        assert_eq!(config.cluster_url.to_string(), "https://10.96.0.1:443/");
        assert!(endpoint.through_cluster_ip());
        assert!(endpoint.describe().contains("ClusterIP"), "{}", endpoint.describe());
        let caveat = endpoint.caveat().unwrap();
        assert!(caveat.contains("--api-server-host") && caveat.contains(ENDPOINT_CONFIG_MAP), "{caveat}");
    }

    #[tokio::test]
    async fn a_missing_token_names_the_file_and_the_way_out() {
        let sa = service_account_dir("missing");
        std::fs::remove_file(sa.0.join("token")).unwrap();
        let dir = sa.0.display().to_string();
        let env = env_of(&[(API_SERVER_HOST_ENV, "10.0.0.1"), (SERVICE_ACCOUNT_DIR_ENV, &dir)]);
        let error = config_with(&KubeOptions::default(), &env).await.unwrap_err().to_string();
        assert!(error.contains(&format!("{dir}/token")) && error.contains("--kubeconfig"), "{error}");
    }
}

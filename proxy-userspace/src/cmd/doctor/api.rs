//! The API server check: does the endpoint the agent would use answer from this node? The endpoint
//! is decided by `k8s::api_endpoint`, the agent's own decision, from the same flags and environment
//! (a doctor run with `kubectl exec` in the agent's pod sees the agent's environment).

use std::time::Duration;

use super::Check;
use crate::k8s::api_endpoint::{self, ENDPOINT_CONFIG_MAP, Endpoint, KubeOptions, Origin};

const NAME: &str = "api-server";
/// Connecting, and then answering `GET /version`, may take this long each: long enough for a
/// loaded API server, short enough that an unreachable ClusterIP does not stall doctor.
const TIMEOUT: Duration = Duration::from_secs(3);

/// What `GET /version` brought.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The server's `gitVersion`.
    Answered(String),
    /// An HTTP error status, with the server's message.
    Refused { code: u16, message: String },
    /// No answer: the connection, TLS or the request failed (why), or the time ran out.
    Unreachable(String),
}

/// How to find the API server's own address on kubeadm, for the fixes.
const KUBEADM_HINT: &str = "on kubeadm it is the control-plane endpoint: \
     kubectl -n kube-system get cm kubeadm-config -o yaml | grep controlPlaneEndpoint";

pub fn api_verdict(endpoint: &Endpoint, probe: &Probe) -> Check {
    let at = endpoint.describe();
    match probe {
        Probe::Answered(version) => Check::ok(NAME, format!("{at} answers GET /version: {version}")),
        Probe::Refused { code: code @ (401 | 403), message } => Check::fail(
            NAME,
            format!("{at} answers GET /version with {code}: {message}"),
            format!(
                "it refuses the credentials ({}): check the service account's token or the kubeconfig",
                endpoint.credentials.describe()
            ),
        ),
        Probe::Refused { code, message } => Check::warn(
            NAME,
            format!("{at} answers GET /version with {code}: {message}"),
            "is this the API server? check --master, --api-server-host/--api-server-port or the kubeconfig",
        ),
        Probe::Unreachable(error) if endpoint.through_cluster_ip() => Check::fail(
            NAME,
            format!(
                "{at} does not answer GET /version: {error}. A ClusterIP works only while something on this \
                 node translates ClusterIPs, and kproxy, the service proxy, cannot sync without the API server"
            ),
            format!(
                "point the agent at the API server itself: --api-server-host HOST --api-server-port PORT, or keys \
                 host and port of ConfigMap {ENDPOINT_CONFIG_MAP} in the agent's namespace (then restart the \
                 DaemonSet); {KUBEADM_HINT}"
            ),
        ),
        Probe::Unreachable(error) => {
            let setting = match &endpoint.origin {
                Origin::ApiServerEnv => format!("host and port of ConfigMap {ENDPOINT_CONFIG_MAP}"),
                origin => origin.describe(),
            };
            Check::fail(
                NAME,
                format!("{at} does not answer GET /version: {error}"),
                format!(
                    "check {setting}: that this node reaches that address and port, and that the API server's \
                     certificate names the host; {KUBEADM_HINT}"
                ),
            )
        }
    }
}

/// Resolves the agent's endpoint with `options` and the environment, and asks it for `/version`.
pub(super) fn api_check(options: &KubeOptions) -> Check {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => return Check::warn(NAME, format!("cannot check: no tokio runtime: {e}"), "retry"),
    };
    let plan = match api_endpoint::plan(options, &api_endpoint::process_env) {
        Ok(plan) => plan,
        Err(e) => return refused_settings(&e),
    };
    runtime.block_on(async {
        match api_endpoint::config(options).await {
            Ok((mut config, endpoint)) => {
                config.connect_timeout = Some(TIMEOUT);
                config.read_timeout = Some(TIMEOUT);
                api_verdict(&endpoint, &probe(config).await)
            }
            // Not in a pod and no kubeconfig: nothing to check, and an agent with --manifests needs none.
            Err(e) if plan.origin == Origin::LocalKubeconfig => Check::warn(
                NAME,
                format!("no API server endpoint to check: {e:#}"),
                "an agent here needs --manifests, or one of these; give doctor the agent's --kubeconfig, \
                 --master or --api-server-host",
            ),
            Err(e) => refused_settings(&e),
        }
    })
}

fn refused_settings(error: &anyhow::Error) -> Check {
    Check::fail(
        NAME,
        format!("the agent's API server settings do not work: {error:#}"),
        "fix the setting named (the agent stops at start with the same error)",
    )
}

async fn probe(config: kube::Config) -> Probe {
    let client = match kube::Client::try_from(config) {
        Ok(client) => client,
        Err(e) => return Probe::Unreachable(crate::k8s::api_watch::describe(&e)),
    };
    match tokio::time::timeout(2 * TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(info)) => Probe::Answered(info.git_version),
        Ok(Err(kube::Error::Api(status))) => {
            Probe::Refused { code: status.code, message: status.message.clone() }
        }
        Ok(Err(e)) => {
            let error = crate::k8s::api_watch::describe(&e);
            // kube's words for the connect timeout.
            let timed_out = error.contains("deadline has elapsed");
            Probe::Unreachable(if timed_out {
                format!("{error} (no connection within {}s)", TIMEOUT.as_secs())
            } else {
                error
            })
        }
        Err(_) => Probe::Unreachable(format!("no answer within {}s", (2 * TIMEOUT).as_secs())),
    }
}

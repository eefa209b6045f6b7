//! Checks of the Kubernetes manifests in `deploy/` (test-only).
//!
//! No cluster and no kustomize binary here, so the kustomizations are built by
//! a small subset of kustomize: `resources` (files and directories) and
//! `patches` with a `path` (strategic merge by kind and name, lists of objects
//! merged by `name`, `volumeMounts` by `mountPath`, other lists replaced, and
//! `$patch: delete` removing a list item).
//! Every built object must deserialize into its k8s-openapi type and serialize
//! back to exactly what was written: a field k8s-openapi does not know would
//! be dropped on the way, so a typo in a field name fails here instead of
//! being silently ignored (or refused) by the API server.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, Namespace, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::{api::resource::Quantity, util::intstr::IntOrString},
};
use serde_yaml::Value;

/// The optional ConfigMap naming the API server (kproxy::k8s::api_endpoint::ENDPOINT_CONFIG_MAP).
const ENDPOINT_CONFIG_MAP: &str = kproxy::k8s::api_endpoint::ENDPOINT_CONFIG_MAP;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The kustomizations an operator applies.
const ENTRY_POINTS: &[&str] =
    &["overlays/privileged", "overlays/capabilities", "overlays/kubeadm", "uninstall"];

fn read_docs(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = <Value as serde::Deserialize>::deserialize(doc)
            .with_context(|| format!("parsing {}", path.display()))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

fn str_at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut current = value;
    for key in path {
        current = current.get(*key)?;
    }
    current.as_str()
}

fn object_id(value: &Value) -> (String, String) {
    (
        str_at(value, &["kind"]).unwrap_or_default().to_string(),
        str_at(value, &["metadata", "name"]).unwrap_or_default().to_string(),
    )
}

/// A built kustomization: its objects, and every file it used.
#[derive(Default)]
struct Built {
    objects: Vec<Value>,
    files: BTreeSet<PathBuf>,
}

fn build(dir: &Path) -> Result<Built> {
    let kustomization = dir.join("kustomization.yaml");
    let docs = read_docs(&kustomization)?;
    ensure!(docs.len() == 1, "{}: one document expected", kustomization.display());
    let doc = &docs[0];
    let mapping = doc.as_mapping().with_context(|| format!("{}: not a mapping", kustomization.display()))?;
    for key in mapping.keys() {
        let key = key.as_str().unwrap_or_default();
        ensure!(
            ["apiVersion", "kind", "resources", "patches"].contains(&key),
            "{}: `{key}` is not supported by this check; extend deploy_manifests.rs",
            kustomization.display()
        );
    }
    ensure!(str_at(doc, &["apiVersion"]) == Some("kustomize.config.k8s.io/v1beta1"));
    ensure!(str_at(doc, &["kind"]) == Some("Kustomization"));
    let mut built = Built::default();
    built.files.insert(kustomization.canonicalize()?);
    let list = |key: &str| doc.get(key).and_then(Value::as_sequence).cloned().unwrap_or_default();
    for resource in list("resources") {
        let relative = resource.as_str().context("a resource is not a string")?;
        let path = dir.join(relative);
        ensure!(path.exists(), "{}: resource {relative} does not exist", kustomization.display());
        if path.is_dir() {
            let inner = build(&path)?;
            built.objects.extend(inner.objects);
            built.files.extend(inner.files);
        } else {
            built.objects.extend(read_docs(&path)?);
            built.files.insert(path.canonicalize()?);
        }
    }
    for patch in list("patches") {
        let relative = str_at(&patch, &["path"]).context("only patches with a path are supported")?;
        let path = dir.join(relative);
        ensure!(path.is_file(), "{}: patch {relative} does not exist", kustomization.display());
        built.files.insert(path.canonicalize()?);
        for patch_doc in read_docs(&path)? {
            let id = object_id(&patch_doc);
            let target = built
                .objects
                .iter_mut()
                .find(|o| object_id(o) == id)
                .with_context(|| format!("{}: patch target {id:?} is not a resource", path.display()))?;
            merge(target, &patch_doc, "").with_context(|| format!("{}", path.display()))?;
        }
    }
    Ok(built)
}

/// Strategic merge patch, the part these manifests use.
fn merge(target: &mut Value, patch: &Value, key: &str) -> Result<()> {
    match (target, patch) {
        (Value::Mapping(target), Value::Mapping(patch)) => {
            for (k, v) in patch {
                let name = k.as_str().unwrap_or_default();
                match target.get_mut(k) {
                    Some(existing) => merge(existing, v, name)?,
                    None => {
                        target.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Sequence(target), Value::Sequence(patch)) => {
            let merge_key = if key == "volumeMounts" { "mountPath" } else { "name" };
            if !patch.iter().all(|item| item.get(merge_key).is_some()) {
                *target = patch.clone();
                return Ok(());
            }
            for item in patch {
                let wanted = item.get(merge_key);
                let position = target.iter().position(|t| t.get(merge_key) == wanted);
                match (item.get("$patch").and_then(Value::as_str), position) {
                    (Some("delete"), Some(at)) => {
                        target.remove(at);
                    }
                    // kustomize ignores it; here a renamed item must not stay behind unnoticed.
                    (Some("delete"), None) => {
                        bail!("`$patch: delete` of {key} item {wanted:?}, which is not there")
                    }
                    (Some(other), _) => bail!("`$patch: {other}` is not supported by this check"),
                    (None, Some(at)) => merge(&mut target[at], item, "")?,
                    (None, None) => target.push(item.clone()),
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
    Ok(())
}

/// Where `original` has something `reparsed` lacks or differs.
fn differences(original: &Value, reparsed: &Value, path: &str, out: &mut Vec<String>) {
    match (original, reparsed) {
        (Value::Mapping(a), Value::Mapping(b)) => {
            for (k, v) in a {
                let key = format!("{path}.{}", k.as_str().unwrap_or("?"));
                match b.get(k) {
                    Some(w) => differences(v, w, &key, out),
                    None => out.push(format!("{key}: unknown field (dropped by k8s-openapi)")),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}.{}: added by k8s-openapi", k.as_str().unwrap_or("?")));
            }
        }
        (Value::Sequence(a), Value::Sequence(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                differences(v, w, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: wrote {a:?}, k8s-openapi reads {b:?}")),
    }
}

fn roundtrip<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) -> Result<T> {
    let typed: T = serde_yaml::from_value(doc.clone())?;
    let back = serde_yaml::to_value(&typed)?;
    let mut out = Vec::new();
    differences(doc, &back, "", &mut out);
    ensure!(out.is_empty(), "{}", out.join("\n"));
    Ok(typed)
}

/// Checks one object against its type; an unexpected kind is an error.
fn check_object(doc: &Value) -> Result<()> {
    let (kind, _) = object_id(doc);
    match kind.as_str() {
        "Namespace" => roundtrip::<Namespace>(doc).map(drop),
        "ServiceAccount" => roundtrip::<ServiceAccount>(doc).map(drop),
        "ClusterRole" => roundtrip::<ClusterRole>(doc).map(drop),
        "ClusterRoleBinding" => roundtrip::<ClusterRoleBinding>(doc).map(drop),
        "ConfigMap" => roundtrip::<ConfigMap>(doc).map(drop),
        "DaemonSet" => roundtrip::<DaemonSet>(doc).map(drop),
        other => bail!("kind {other:?} is not checked; add it to deploy_manifests.rs"),
    }
}

fn built(entry: &str) -> Built {
    build(&deploy_dir().join(entry)).unwrap_or_else(|e| panic!("deploy/{entry}: {e:#}"))
}

fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(built: &Built, kind: &str, name: &str) -> T {
    let doc = built
        .objects
        .iter()
        .find(|o| object_id(o) == (kind.to_string(), name.to_string()))
        .unwrap_or_else(|| panic!("no {kind} {name}"));
    roundtrip(doc).unwrap()
}

fn agent_daemonset(built: &Built) -> DaemonSet {
    typed(built, "DaemonSet", "kproxy")
}

fn container_named<'a>(ds: &'a DaemonSet, name: &str) -> Option<&'a Container> {
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    spec.containers.iter().chain(spec.init_containers.iter().flatten()).find(|c| c.name == name)
}

fn container<'a>(ds: &'a DaemonSet, name: &str) -> &'a Container {
    container_named(ds, name).unwrap_or_else(|| panic!("no container {name}"))
}

fn yaml_files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.insert(path.canonicalize().unwrap());
        }
    }
}

#[test]
fn every_object_roundtrips_through_k8s_openapi() {
    let mut errors = Vec::new();
    for entry in ["base", "overlays/privileged", "overlays/capabilities", "overlays/kubeadm", "uninstall"] {
        for doc in built(entry).objects {
            if let Err(e) = check_object(&doc) {
                errors.push(format!("deploy/{entry}: {:?}: {e:#}", object_id(&doc)));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn the_roundtrip_check_catches_unknown_and_misspelled_fields() {
    let doc: Value = serde_yaml::from_str(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n  namespace: y\ndata:\n  a: b\n",
    )
    .unwrap();
    check_object(&doc).unwrap();
    let mut bad = doc.clone();
    merge(&mut bad, &serde_yaml::from_str("metadata:\n  namesapce: y\n").unwrap(), "").unwrap();
    let error = format!("{:#}", check_object(&bad).unwrap_err());
    assert!(error.contains(".metadata.namesapce: unknown field"), "{error}");
    let ds: Value = serde_yaml::from_str(
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {}\n  template:\n    spec:\n      hostNetwrok: true\n      containers: []\n",
    )
    .unwrap();
    let error = format!("{:#}", check_object(&ds).unwrap_err());
    assert!(error.contains(".spec.template.spec.hostNetwrok: unknown field"), "{error}");
    assert!(check_object(&serde_yaml::from_str("kind: Pod\n").unwrap()).is_err());
}

#[test]
fn kustomizations_use_every_file_and_only_existing_ones() {
    let mut used = BTreeSet::new();
    for entry in ENTRY_POINTS {
        used.extend(built(entry).files);
    }
    let mut all = BTreeSet::new();
    yaml_files(&deploy_dir(), &mut all);
    let unused: Vec<_> = all.difference(&used).collect();
    assert!(unused.is_empty(), "YAML files no kustomization uses: {unused:?}");
    // A missing file is an error, not an empty resource.
    let scratch = std::env::temp_dir().join(format!("kproxy-kustomize-check-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    std::fs::write(
        scratch.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [missing.yaml]\n",
    )
    .unwrap();
    let error = build(&scratch).err().map(|e| format!("{e:#}"));
    std::fs::remove_dir_all(&scratch).unwrap();
    assert!(error.unwrap_or_default().contains("resource missing.yaml does not exist"));
}

/// What the agent does with the API server (source.rs): watchers (list +
/// watch) on Services and EndpointSlices in all namespaces and on its Node;
/// it writes nothing.
#[test]
fn cluster_role_grants_exactly_what_the_agent_uses() {
    let base = built("base");
    let role: ClusterRole = typed(&base, "ClusterRole", "kproxy");
    let mut granted: BTreeSet<(String, String, String)> = BTreeSet::new();
    for rule in role.rules.unwrap() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.unwrap() {
            for resource in rule.resources.clone().unwrap() {
                for verb in &rule.verbs {
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let mut expected = BTreeSet::new();
    for (group, resource, verbs) in [
        ("", "services", &["list", "watch"][..]),
        ("", "nodes", &["list", "watch"]),
        ("discovery.k8s.io", "endpointslices", &["list", "watch"]),
    ] {
        for verb in verbs {
            expected.insert((group.to_string(), resource.to_string(), verb.to_string()));
        }
    }
    assert_eq!(granted, expected);

    let binding: ClusterRoleBinding = typed(&base, "ClusterRoleBinding", "kproxy");
    assert_eq!((binding.role_ref.kind.as_str(), binding.role_ref.name.as_str()), ("ClusterRole", "kproxy"));
    let subjects = binding.subjects.unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (subjects[0].kind.as_str(), subjects[0].name.as_str(), subjects[0].namespace.as_deref()),
        ("ServiceAccount", "kproxy", Some("kproxy-system"))
    );
    let ds = agent_daemonset(&base);
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("kproxy"));
    let _: ServiceAccount = typed(&base, "ServiceAccount", "kproxy");
}

#[test]
fn agent_daemonset_runs_on_every_node_in_the_host_network() {
    let base = built("base");
    let ds = agent_daemonset(&base);
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kproxy-system"));
    let spec = ds.spec.as_ref().unwrap();
    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(strategy.rolling_update.as_ref().unwrap().max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(spec.selector.match_labels, spec.template.metadata.as_ref().unwrap().labels);
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    // Linux nodes only: eBPF tc and the kproxy image do not exist on Windows nodes, which the
    // tolerations would otherwise admit.
    let linux = BTreeMap::from([("kubernetes.io/os".to_string(), "linux".to_string())]);
    assert_eq!(pod.node_selector.as_ref(), Some(&linux));
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert_eq!(tolerations.len(), 1);
    assert_eq!(tolerations[0].operator.as_deref(), Some("Exists"));
    assert!(tolerations[0].key.is_none() && tolerations[0].effect.is_none());

    let volumes: BTreeMap<&str, &str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| (v.name.as_str(), v.host_path.as_ref().unwrap().path.as_str()))
        .collect();
    assert_eq!(volumes["bpffs"], "/sys/fs/bpf");
    assert_eq!(volumes["cgroup2"], "/sys/fs/cgroup");

    let init = container(&ds, "mount-bpffs");
    assert_eq!(init.security_context.as_ref().unwrap().privileged, Some(true));
    let script = init.command.as_ref().unwrap().join(" ");
    assert!(
        script
            .contains("mount | grep -q ' /sys/fs/bpf type bpf' || mount -t bpf -o mode=0700 bpf /sys/fs/bpf"),
        "{script}"
    );
    let mount = &init.volume_mounts.as_ref().unwrap()[0];
    assert_eq!(
        (mount.name.as_str(), mount.mount_path.as_str(), mount.mount_propagation.as_deref()),
        ("bpffs", "/sys/fs/bpf", Some("Bidirectional"))
    );

    let agent = container(&ds, "kproxy");
    let args = agent.args.as_ref().unwrap();
    assert_eq!(args[0], "agent");
    assert!(args.contains(&"--hostname-override=$(NODE_NAME)".to_string()));
    let env = agent.env.as_ref().unwrap();
    let node_name = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    assert_eq!(
        node_name.value_from.as_ref().unwrap().field_ref.as_ref().unwrap().field_path,
        "spec.nodeName"
    );
    let mounts: BTreeMap<&str, &str> =
        agent.volume_mounts.iter().flatten().map(|m| (m.name.as_str(), m.mount_path.as_str())).collect();
    assert_eq!(mounts["bpffs"], "/sys/fs/bpf");
    assert!(mounts.contains_key("cgroup2"));

    let probe = |probe: &Option<k8s_openapi::api::core::v1::Probe>| {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        (get.path.clone().unwrap(), get.port.clone())
    };
    assert_eq!(probe(&agent.readiness_probe), ("/healthz".to_string(), IntOrString::Int(10256)));
    assert_eq!(probe(&agent.liveness_probe), ("/livez".to_string(), IntOrString::Int(10256)));
}

/// Every `$(VAR)` in the args is an env var of the container, every
/// ConfigMap key the DaemonSet reads exists, and every key is used; the
/// probes' port is the one the ConfigMap binds.
#[test]
fn agent_flags_come_from_the_config_map() {
    let base = built("base");
    let config: ConfigMap = typed(&base, "ConfigMap", "kproxy-config");
    let data = config.data.unwrap();
    let ds = agent_daemonset(&base);
    let agent = container(&ds, "kproxy");
    let env = agent.env.as_ref().unwrap();
    let mut used_keys = BTreeSet::new();
    for var in env {
        if let Some(key_ref) = var.value_from.as_ref().and_then(|v| v.config_map_key_ref.as_ref()) {
            if key_ref.name == ENDPOINT_CONFIG_MAP {
                continue; // optional, and not flags: api_endpoint_comes_from_an_optional_config_map
            }
            assert_eq!(key_ref.name, "kproxy-config");
            assert!(data.contains_key(&key_ref.key), "ConfigMap has no key {}", key_ref.key);
            assert_ne!(key_ref.optional, Some(true));
            used_keys.insert(key_ref.key.clone());
        }
    }
    let defined: BTreeSet<&str> = env.iter().map(|e| e.name.as_str()).collect();
    for arg in agent.args.as_ref().unwrap() {
        for var in arg.split("$(").skip(1).filter_map(|rest| rest.split_once(')')).map(|(v, _)| v) {
            assert!(defined.contains(var), "{arg} uses $({var}), which is not an env var of the container");
        }
        // A flag fed by the ConfigMap is passed under the key's name.
        if let Some((flag, value)) = arg.strip_prefix("--").and_then(|a| a.split_once('='))
            && let Some(var) = value.strip_prefix("$(").and_then(|v| v.strip_suffix(')'))
            && let Some(key_ref) = env
                .iter()
                .find(|e| e.name == var)
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.config_map_key_ref.as_ref())
        {
            assert_eq!(flag, key_ref.key, "{arg}");
        }
    }
    let unused: Vec<&String> = data.keys().filter(|k| !used_keys.contains(*k)).collect();
    assert!(unused.is_empty(), "ConfigMap keys the DaemonSet never reads: {unused:?}");
    let port = data["healthz-bind-address"].rsplit_once(':').unwrap().1.parse::<i32>().unwrap();
    assert_eq!(agent.ports.as_ref().unwrap()[0].container_port, port);
    assert_eq!(
        agent.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap().port,
        IntOrString::Int(port)
    );
}

/// The explicit API server endpoint: every overlay's agent takes KPROXY_API_SERVER_HOST/PORT (the
/// names the agent reads) from keys host and port of the optional ConfigMap kproxy-api-endpoint,
/// which no kustomization creates (unset: the in-cluster ClusterIP, and a re-apply must not
/// overwrite the operator's ConfigMap).
#[test]
fn api_endpoint_comes_from_an_optional_config_map() {
    use kproxy::k8s::api_endpoint::{API_SERVER_HOST_ENV, API_SERVER_PORT_ENV};
    for entry in ENTRY_POINTS.iter().filter(|e| !e.starts_with("uninstall")) {
        let built = built(entry);
        assert!(
            built
                .objects
                .iter()
                .all(|o| object_id(o) != ("ConfigMap".to_owned(), ENDPOINT_CONFIG_MAP.to_owned())),
            "{entry} creates {ENDPOINT_CONFIG_MAP}"
        );
        let ds = agent_daemonset(&built);
        let env = container(&ds, "kproxy").env.clone().unwrap_or_default();
        for (name, key) in [(API_SERVER_HOST_ENV, "host"), (API_SERVER_PORT_ENV, "port")] {
            let var = env.iter().find(|e| e.name == name).unwrap_or_else(|| panic!("{entry}: no env {name}"));
            let key_ref = var.value_from.as_ref().and_then(|v| v.config_map_key_ref.as_ref()).unwrap();
            assert_eq!((key_ref.name.as_str(), key_ref.key.as_str()), (ENDPOINT_CONFIG_MAP, key), "{entry}");
            assert_eq!(key_ref.optional, Some(true), "{entry}: {name} must not need the ConfigMap");
        }
    }
}

/// Every DaemonSet of every kustomization an operator applies selects Linux nodes (the uninstall
/// one too: a pod on a Windows node would keep its rollout from ever completing).
#[test]
fn every_daemonset_selects_linux_nodes() {
    for entry in ENTRY_POINTS {
        for doc in built(entry).objects.iter().filter(|o| object_id(o).0 == "DaemonSet") {
            let ds: DaemonSet = roundtrip(doc).unwrap();
            let pod = ds.spec.unwrap().template.spec.unwrap();
            let os = pod.node_selector.as_ref().and_then(|s| s.get("kubernetes.io/os"));
            assert_eq!(os.map(String::as_str), Some("linux"), "deploy/{entry}: {:?}", ds.metadata.name);
        }
    }
}

/// The kubeadm overlay: `--config` on kube-proxy's config.conf, mounted from the ConfigMap
/// `kube-proxy` (kubeadm's, copied into kproxy-system) with the kubeconfig.conf that
/// config.conf names; no flag for a setting config.conf holds (a flag would win over the file);
/// the rest as the privileged overlay.
#[test]
fn kubeadm_overlay_runs_the_agent_on_kube_proxys_config() {
    const FILE_SETTINGS: [&str; 5] =
        ["min-sync-period", "sync-period", "healthz-bind-address", "metrics-bind-address", "log-format"];
    let kubeadm = agent_daemonset(&built("overlays/kubeadm"));
    let privileged = agent_daemonset(&built("overlays/privileged"));
    let agent = container(&kubeadm, "kproxy");
    let args = agent.args.as_ref().unwrap();
    assert_eq!(args[0], "agent");
    assert!(args.contains(&"--config=/var/lib/kube-proxy/config.conf".to_string()), "{args:?}");
    assert!(args.contains(&"--hostname-override=$(NODE_NAME)".to_string()), "{args:?}");
    for flag in FILE_SETTINGS {
        assert!(
            !args.iter().any(|a| a.starts_with(&format!("--{flag}"))),
            "--{flag} would win over the file"
        );
    }
    // Every other flag of the base is still passed, and every $(VAR) is still an env var.
    let base_args = container(&privileged, "kproxy").args.clone().unwrap();
    for arg in &base_args {
        let flag = arg.split('=').next().unwrap().trim_start_matches('-');
        assert!(FILE_SETTINGS.contains(&flag) || args.contains(arg), "{arg} is missing");
    }
    let env: BTreeSet<&str> = agent.env.iter().flatten().map(|e| e.name.as_str()).collect();
    for arg in args {
        for var in arg.split("$(").skip(1).filter_map(|rest| rest.split_once(')')).map(|(v, _)| v) {
            assert!(env.contains(var), "{arg} uses $({var}), which is not an env var");
        }
    }
    assert!(!env.iter().any(|v| v.ends_with("_BIND_ADDRESS")), "unused env vars left: {env:?}");

    let mount = agent.volume_mounts.iter().flatten().find(|m| m.mount_path == "/var/lib/kube-proxy").unwrap();
    assert_eq!(mount.read_only, Some(true));
    let pod = kubeadm.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let volume = pod.volumes.iter().flatten().find(|v| v.name == mount.name).unwrap();
    let config_map = volume.config_map.as_ref().unwrap();
    assert_eq!(config_map.name, "kube-proxy");
    assert!(config_map.items.is_none(), "both config.conf and kubeconfig.conf are needed");
    assert_ne!(config_map.optional, Some(true));

    // Otherwise the privileged overlay's agent.
    let theirs = container(&privileged, "kproxy");
    assert_eq!(agent.security_context, theirs.security_context);
    assert_eq!(agent.resources, theirs.resources);
    assert_eq!(agent.readiness_probe, theirs.readiness_probe);
    assert_eq!(agent.volume_mounts.as_ref().unwrap().len(), theirs.volume_mounts.as_ref().unwrap().len() + 1);
}

#[test]
fn overlays_set_the_agent_security_context() {
    let privileged = agent_daemonset(&built("overlays/privileged"));
    let agent = container(&privileged, "kproxy");
    let context = agent.security_context.as_ref().unwrap();
    assert_eq!(context.privileged, Some(true));
    assert!(context.capabilities.is_none());
    let bpffs = agent.volume_mounts.iter().flatten().find(|m| m.name == "bpffs").unwrap();
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("Bidirectional"));
    // The privileged install keeps the init container that mounts bpffs for the host.
    assert!(container_named(&privileged, "mount-bpffs").is_some());

    let capabilities = agent_daemonset(&built("overlays/capabilities"));
    let agent = container(&capabilities, "kproxy");
    // Bidirectional propagation is only allowed in privileged containers.
    let bpffs = agent.volume_mounts.iter().flatten().find(|m| m.name == "bpffs").unwrap();
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("HostToContainer"));
    // The patch merged into the base container instead of replacing it.
    assert_eq!(agent.args, container(&privileged, "kproxy").args);
    assert_eq!(agent.resources, container(&privileged, "kproxy").resources);
    assert_eq!(agent.volume_mounts.as_ref().unwrap().len(), 3);
}

/// The capabilities overlay: every capability dropped and only those added that the agent was
/// seen to fail without (tests/tests/deploy/capabilities.rs runs the real agent with exactly the
/// set it reads from security.yaml, and with each one removed); nothing privileged in any
/// container, init containers included; no privilege escalation; a read-only root filesystem (the
/// agent writes only pins, into the bpffs volume); the runtime's seccomp profile.
#[test]
fn capabilities_overlay_is_hardened() {
    let built = built("overlays/capabilities");
    for doc in built.objects.iter().filter(|o| object_id(o).0 == "DaemonSet") {
        let ds: DaemonSet = roundtrip(doc).unwrap();
        let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_ne!(pod.host_pid, Some(true));
        assert_ne!(pod.host_ipc, Some(true));
        for c in pod.containers.iter().chain(pod.init_containers.iter().flatten()) {
            let privileged = c.security_context.as_ref().and_then(|s| s.privileged);
            assert_ne!(privileged, Some(true), "container {} is privileged", c.name);
            for mount in c.volume_mounts.iter().flatten() {
                assert_ne!(mount.mount_propagation.as_deref(), Some("Bidirectional"), "{}", c.name);
            }
        }
        // The privileged mount-bpffs is deleted, not made unprivileged: without Bidirectional
        // propagation its mount would be the pod's own.
        assert!(pod.init_containers.as_ref().is_none_or(Vec::is_empty), "{:?}", pod.init_containers);
    }

    let ds = agent_daemonset(&built);
    let agent = container(&ds, "kproxy");
    let context = agent.security_context.as_ref().unwrap();
    assert_eq!(context.privileged, Some(false));
    assert_eq!(context.allow_privilege_escalation, Some(false));
    assert_eq!(context.read_only_root_filesystem, Some(true));
    let caps = context.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert_eq!(caps.add.as_deref().unwrap(), ["BPF", "NET_ADMIN"]);
    let pod_context = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap().security_context.as_ref();
    let seccomp = context
        .seccomp_profile
        .as_ref()
        .or_else(|| pod_context.and_then(|p| p.seccomp_profile.as_ref()))
        .expect("a seccomp profile");
    assert_eq!(seccomp.type_, "RuntimeDefault");
    // The runtime's default AppArmor profile denies writes under /sys/fs/ but cgroup, so pins
    // could be neither created nor removed in /sys/fs/bpf.
    assert_eq!(context.app_armor_profile.as_ref().map(|p| p.type_.as_str()), Some("Unconfined"));
    // Writable with a read-only root: only its volumes, all of them the host's.
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    for mount in agent.volume_mounts.iter().flatten() {
        let volume = pod.volumes.iter().flatten().find(|v| v.name == mount.name).unwrap();
        assert!(volume.host_path.is_some(), "{} is not a hostPath", mount.name);
    }
}

fn bytes(quantity: &Quantity) -> u64 {
    let text = quantity.0.as_str();
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let unit = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        other => panic!("unit {other:?} of {text:?} not handled here"),
    };
    number.parse::<u64>().unwrap() * unit
}

/// Sized from measurements (docs/deploy.md, "Resources"): with 10k Services the agent's memory
/// cgroup peaked at 202 MiB on a fresh node, 123 MiB of it the BPF maps its first start creates.
/// A CPU limit would only slow syncs, so there is none.
#[test]
fn agent_has_a_memory_request_and_limit_in_every_overlay() {
    for entry in ["overlays/privileged", "overlays/capabilities", "overlays/kubeadm"] {
        let ds = agent_daemonset(&built(entry));
        let resources = container(&ds, "kproxy").resources.clone().unwrap();
        let requests = resources.requests.unwrap();
        let limits = resources.limits.unwrap();
        assert!(requests.contains_key("cpu"), "{entry}");
        assert!(!limits.contains_key("cpu"), "{entry}: a CPU limit only throttles syncs");
        let (request, limit) = (bytes(&requests["memory"]), bytes(&limits["memory"]));
        assert!(request >= 256 << 20, "{entry}: the measured peak does not fit in {request} bytes");
        assert!(limit >= request, "{entry}");
    }
}

#[test]
fn patch_delete_removes_a_list_item_and_refuses_a_missing_one() {
    let yaml = |text: &str| -> Value { serde_yaml::from_str(text).unwrap() };
    let mut ds = yaml("spec:\n  initContainers:\n  - {name: a, image: x}\n  - {name: b}\n");
    merge(&mut ds, &yaml("spec:\n  initContainers:\n  - {name: a, $patch: delete}\n"), "").unwrap();
    assert_eq!(ds, yaml("spec:\n  initContainers:\n  - {name: b}\n"));
    let error = merge(&mut ds, &yaml("spec:\n  initContainers:\n  - {name: a, $patch: delete}\n"), "")
        .unwrap_err()
        .to_string();
    assert!(error.contains("not there"), "{error}");
    assert!(merge(&mut ds, &yaml("spec:\n  initContainers:\n  - {name: b, $patch: replace}\n"), "").is_err());
}

#[test]
fn uninstall_unloads_on_every_node() {
    let uninstall = built("uninstall");
    let namespaces: Vec<Namespace> = uninstall
        .objects
        .iter()
        .filter(|o| object_id(o).0 == "Namespace")
        .map(|o| roundtrip(o).unwrap())
        .collect();
    assert_eq!(namespaces.len(), 1);
    assert_ne!(namespaces[0].metadata.name.as_deref(), Some("kproxy-system"));
    let ds: DaemonSet = typed(&uninstall, "DaemonSet", "kproxy-unload");
    assert_eq!(ds.metadata.namespace, namespaces[0].metadata.name);
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.tolerations.as_ref().unwrap()[0].operator.as_deref(), Some("Exists"));
    assert_eq!(pod.host_network, Some(true));
    let unload = &pod.containers[0];
    let script = unload.command.as_ref().unwrap().join(" ");
    assert!(script.contains("kproxy unload &&") && script.ends_with("exec sleep infinity"), "{script}");
    let bpffs = unload.volume_mounts.iter().flatten().find(|m| m.mount_path == "/sys/fs/bpf").unwrap();
    let volume = pod.volumes.iter().flatten().find(|v| v.name == bpffs.name).unwrap();
    assert_eq!(volume.host_path.as_ref().unwrap().path, "/sys/fs/bpf");
}

//! What the agent would program: the same sources, label selector and model as `kproxy agent`.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use k8s_openapi::{
    Metadata,
    api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::DiffArgs;
use crate::{
    k8s::api_watch::KubeOptions,
    k8s::manifest::{self, ManifestError, Sourced},
    model::{self, Desired, ModelOptions, service_cidrs},
    net::Cidr,
};

/// What the agent would program: the frontends, and the IPv4 service CIDRs SERVICE_CIDRS_V4 would hold.
pub(super) struct Wanted {
    pub desired: Desired,
    pub service_cidrs: Vec<Cidr>,
}

/// What the agent would program, from the same source it would read.
pub(super) fn desired(args: &DiffArgs) -> Result<Wanted> {
    let flag_cidrs =
        service_cidrs::parse_flag(&args.service_cidr).map_err(|e| anyhow::anyhow!("--service-cidr: {e}"))?;
    let (services, slices, cidr_objects, source_errors) = match &args.manifests {
        Some(path) => {
            if !path.exists() {
                anyhow::bail!("--manifests {}: no such file or directory", path.display());
            }
            from_files(manifest::load_path(path))
        }
        None => from_cluster(
            &KubeOptions {
                kubeconfig: args.kubeconfig.clone(),
                master: args.master.clone(),
                ..Default::default()
            },
            args.service_proxy_name.as_deref(),
        )?,
    };
    let options = ModelOptions {
        node_name: args.hostname_override.clone(),
        service_proxy_name: args.service_proxy_name.clone(),
        ..Default::default()
    };
    let (desired, model_errors) = model::build_with(&services, &slices, &options);
    let (cidrs, cidr_errors) = service_cidrs::resolve(&flag_cidrs, &cidr_objects);
    for error in source_errors.iter().chain(&model_errors).chain(&cidr_errors) {
        tracing::warn!("{error}");
    }
    let wanted_cidrs =
        cidrs.ipv4.into_iter().map(Cidr::V4).chain(cidrs.ipv6.into_iter().map(Cidr::V6)).collect();
    Ok(Wanted { desired, service_cidrs: wanted_cidrs })
}

type Objects =
    (Vec<Sourced<Service>>, Vec<Sourced<EndpointSlice>>, Vec<Sourced<ServiceCIDR>>, Vec<ManifestError>);

/// In the order the agent's file source hands them to the model (by
/// namespace, name, then position), so conflicts resolve the same way.
fn from_files(objects: manifest::Objects) -> Objects {
    fn ordered<T: Metadata<Ty = ObjectMeta>>(items: Vec<Sourced<T>>) -> Vec<Sourced<T>> {
        let mut keyed: BTreeMap<(String, String, u32), Sourced<T>> = BTreeMap::new();
        for (i, item) in items.into_iter().enumerate() {
            let m = item.object.metadata();
            let key = (m.namespace.clone().unwrap_or_default(), m.name.clone().unwrap_or_default(), i as u32);
            keyed.insert(key, item);
        }
        keyed.into_values().collect()
    }
    (ordered(objects.services), ordered(objects.slices), objects.service_cidrs, objects.errors)
}

/// One list of Services and EndpointSlices, with the agent's label selector.
fn from_cluster(options: &KubeOptions, service_proxy_name: Option<&str>) -> Result<Objects> {
    use kube::{Api, api::ListParams};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(async {
        let client = crate::k8s::api_watch::client(options).await?;
        let params = ListParams::default().labels(&crate::k8s::api_watch::label_selector(service_proxy_name));
        let services = Api::<Service>::all(client.clone()).list(&params).await.context("listing Services")?;
        let slices = Api::<EndpointSlice>::all(client.clone())
            .list(&params)
            .await
            .context("listing EndpointSlices")?;
        // Every ServiceCIDR, unselected, as the agent watches them; a server before Kubernetes 1.33 has none
        // to list (404), and the agent then drops with --service-cidr alone.
        let cidrs = match Api::<ServiceCIDR>::all(client).list(&ListParams::default()).await {
            Ok(list) => listed("ServiceCIDR", list.items),
            Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
            Err(e) => return Err(e).context("listing ServiceCIDRs"),
        };
        Ok((listed("Service", services.items), listed("EndpointSlice", slices.items), cidrs, Vec::new()))
    })
}

/// Listed objects as the agent's watch source holds them: named by their resourceVersion, sorted by namespace
/// and name.
fn listed<T: Metadata<Ty = ObjectMeta>>(kind: &str, items: Vec<T>) -> Vec<Sourced<T>> {
    let mut sourced: Vec<Sourced<T>> = items
        .into_iter()
        .map(|object| {
            let version = object.metadata().resource_version.clone().unwrap_or_default();
            Sourced { origin: format!("api-server {kind} (resourceVersion {version})"), object }
        })
        .collect();
    sourced.sort_by(|a, b| {
        let (a, b) = (a.object.metadata(), b.object.metadata());
        (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name))
    });
    sourced
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_are_ordered_like_the_agent() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: b, namespace: x}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: x}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";
        let (services, _, _, _) = from_files(manifest::parse_str(text, "test"));
        let names: Vec<_> = services.iter().map(|s| s.object.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["a", "b"]);
    }
}

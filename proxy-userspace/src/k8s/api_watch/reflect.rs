//! The hand-written reflector: one kind listed (paged), then watched from the list's
//! resourceVersion, resumed, listed again or backed off as client-go's reflector does (see
//! [`watch_cluster`](super::watch_cluster)).

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::AsyncBufReadExt as _;
use kube::{
    Api, Client, ResourceExt as _,
    api::{ListParams, WatchEvent, WatchParams},
    runtime::{utils::Backoff as _, watcher::DefaultBackoff},
};
use serde::de::DeserializeOwned;

use super::{WatchOptions, WatchProgress};

/// Objects per list page, as client-go's pager and kube-runtime ask.
const LIST_PAGE: u32 = 500;
/// A list page unanswered this long is given up: twice kube-apiserver's own
/// limit for a non-watch request (`--request-timeout`, 1 minute). A slow list
/// is waited for (and reported by `/healthz`), not cut short.
const LIST_TIMEOUT: Duration = Duration::from_secs(120);
/// A watch that ends sooner than this with nothing in it counts as a failure
/// (backed off), as client-go's reflector treats a "very short watch".
const SHORT_WATCH: Duration = Duration::from_secs(1);

pub(super) struct Selectors {
    pub(super) labels: Option<String>,
    pub(super) fields: Option<String>,
}

/// What a list or watch brings.
pub(super) enum Update<K, L = Box<K>> {
    /// Every object, from a complete list: replaces what was there. Each page's objects are made into
    /// what the caller keeps (`L`: boxed, or kept compactly) as the page arrives, so a list of 10k
    /// decoded objects never exists at once (40 MiB of Services and EndpointSlices, the agent's peak).
    Listed(Vec<L>),
    Applied(K),
    Deleted(K),
}

/// How one watch request ended.
enum WatchEnd {
    /// Closed by the server or the network: watch again from this version.
    Closed(String),
    /// Failed: after a backoff, watch again from this version, or list again.
    Failed { resume: Option<String>, error: String },
}

impl WatchEnd {
    fn failed(resume: Option<String>, error: String) -> Self {
        WatchEnd::Failed { resume, error }
    }
}

/// Lists then watches `api` for ever, handing each change to `apply` (see
/// [`watch_cluster`]) and telling `health` how it goes.
pub(super) async fn reflect<K, L>(
    client: Client,
    selectors: Selectors,
    options: WatchOptions,
    health: Option<Arc<dyn WatchProgress>>,
    listed: fn(K) -> L,
    mut apply: impl FnMut(Update<K, L>),
) where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let kind = K::kind(&());
    let api: Api<K> = Api::all(client.clone());
    let (list_params, watch_params) = request_params(selectors, options);
    let mut backoff = DefaultBackoff::default();
    let mut resume: Option<String> = None;
    let mut last_listed: Option<tokio::time::Instant> = None;
    loop {
        let error = match resume.take() {
            None => match list_and_apply(&api, &list_params, health.as_ref(), listed, &mut apply).await {
                Ok(version) => {
                    backoff.reset();
                    resume = Some(version);
                    last_listed = Some(tokio::time::Instant::now());
                    continue;
                }
                Err(error) => error,
            },
            Some(version) => {
                let request = WatchRequest {
                    client: &client,
                    url_path: api.resource_url(),
                    params: &watch_params,
                    options,
                    health: health.as_ref(),
                };
                match watch_once(&request, version, &mut apply, &mut backoff).await {
                    WatchEnd::Closed(version) => {
                        resume = Some(version);
                        continue;
                    }
                    WatchEnd::Failed { resume: next, error } => {
                        if let Some(health) = &health {
                            health.failed(&error);
                        }
                        resume = next;
                        // A 410 or a lost change: the server answers, the view is stale, so list
                        // at once; unless the last list was just now (a server that fails every
                        // watch that way is backed off like any failure).
                        if resume.is_none() && last_listed.is_none_or(|at| at.elapsed() >= SHORT_WATCH) {
                            tracing::warn!(%kind, %error, "watch failed; listing again");
                            continue;
                        }
                        error
                    }
                }
            }
        };
        let delay = backoff.next().unwrap_or(Duration::from_secs(30));
        tracing::warn!(%kind, %error, retry_in_ms = delay.as_millis() as u64, "watch failed; retrying");
        tokio::time::sleep(delay).await;
    }
}

/// The list (paged) and watch (with bookmarks, ended by the server) parameters of one kind.
fn request_params(selectors: Selectors, options: WatchOptions) -> (ListParams, WatchParams) {
    let list_params = ListParams {
        label_selector: selectors.labels.clone(),
        field_selector: selectors.fields.clone(),
        limit: Some(LIST_PAGE),
        ..Default::default()
    };
    let watch_params = WatchParams {
        label_selector: selectors.labels,
        field_selector: selectors.fields,
        timeout: Some(options.watch_timeout_secs()),
        bookmarks: true,
        ..Default::default()
    };
    (list_params, watch_params)
}

/// One complete list handed to `apply`: the version to watch from, or the error to back off on.
async fn list_and_apply<K, L>(
    api: &Api<K>,
    params: &ListParams,
    health: Option<&Arc<dyn WatchProgress>>,
    listed: fn(K) -> L,
    apply: &mut impl FnMut(Update<K, L>),
) -> Result<String, String>
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let kind = K::kind(&());
    if let Some(health) = health {
        health.listing(SystemTime::now());
    }
    match list_all(api, params, listed).await {
        Ok((objects, version)) => {
            tracing::info!(objects = objects.len(), resource_version = %version, "listed the {kind}s");
            if let Some(health) = health {
                health.listed(SystemTime::now());
            }
            apply(Update::Listed(objects));
            Ok(version)
        }
        Err(error) => {
            if let Some(health) = health {
                health.list_failed(&error);
            }
            Err(format!("list failed: {error}"))
        }
    }
}

/// Every page of a list: the objects and the list's resourceVersion.
async fn list_all<K, L>(
    api: &Api<K>,
    params: &ListParams,
    listed: fn(K) -> L,
) -> Result<(Vec<L>, String), String>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut params = params.clone();
    let mut objects = Vec::new();
    loop {
        let page = tokio::time::timeout(LIST_TIMEOUT, api.list(&params))
            .await
            .map_err(|_| format!("no answer within {}s", LIST_TIMEOUT.as_secs()))?
            .map_err(|error| describe(&error))?;
        objects.extend(page.items.into_iter().map(listed));
        match page.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => {
                let version = page.metadata.resource_version.filter(|v| !v.is_empty());
                return version
                    .map(|v| (objects, v))
                    .ok_or_else(|| "the list has no resourceVersion".to_owned());
            }
        }
    }
}

/// What every watch request of one kind shares.
struct WatchRequest<'a> {
    client: &'a Client,
    url_path: &'a str,
    params: &'a WatchParams,
    options: WatchOptions,
    health: Option<&'a Arc<dyn WatchProgress>>,
}

/// One watch request from `version`, until it ends. The stream is read line
/// by line here rather than through `Api::watch`, which silently skips a
/// line that is cut short JSON (its change would be lost unnoticed).
async fn watch_once<K, L>(
    watch: &WatchRequest<'_>,
    mut version: String,
    apply: &mut impl FnMut(Update<K, L>),
    backoff: &mut DefaultBackoff,
) -> WatchEnd
where
    K: DeserializeOwned + kube::Resource,
{
    let opened = tokio::time::Instant::now();
    let body = match open_watch(watch, &version).await {
        Ok(body) => body,
        Err(end) => return end,
    };
    // Accepted from `version`: the server will send whatever changed since.
    if let Some(health) = watch.health {
        health.progress(SystemTime::now());
    }
    let mut body = std::pin::pin!(body);
    let mut line = String::new();
    let mut lines = 0u64;
    loop {
        line.clear();
        let idle_cutoff = watch.options.idle_cutoff();
        let read = tokio::time::timeout(idle_cutoff, body.read_line(&mut line)).await;
        let read = match bytes_read(read, idle_cutoff, &version) {
            Ok(read) => read,
            Err(end) => return end,
        };
        if read == 0 {
            return stream_closed(lines, opened, version);
        }
        if !line.ends_with('\n') {
            // Cut mid-line: whatever it carried comes again from `version`.
            return WatchEnd::failed(
                Some(version),
                "watch: the stream ended in the middle of a line".to_owned(),
            );
        }
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let (update, next_version) =
            match parse_event::<K>(text).and_then(|event| event_update(event, &version)) {
                Ok(step) => step,
                Err(end) => return end,
            };
        version = next_version;
        lines += 1;
        backoff.reset();
        if let Some(health) = watch.health {
            health.progress(SystemTime::now());
        }
        if let Some(update) = update {
            apply(update);
        }
    }
}

/// Sends the watch request from `version` and waits for the server to accept it.
async fn open_watch<'w>(
    watch: &WatchRequest<'w>,
    version: &str,
) -> Result<impl futures::AsyncBufRead + use<'w>, WatchEnd> {
    let WatchRequest { client, url_path, params, options, .. } = *watch;
    let request = match kube::core::Request::new(url_path).watch(params, version) {
        Ok(request) => request,
        Err(error) => return Err(WatchEnd::failed(Some(version.to_owned()), format!("watch: {error}"))),
    };
    match tokio::time::timeout(options.progress_timeout, client.request_stream(request)).await {
        Err(_) => {
            let error = format!("watch: no answer within {}s", options.progress_timeout.as_secs_f64());
            Err(WatchEnd::failed(Some(version.to_owned()), error))
        }
        Ok(Err(kube::Error::Api(status))) if status.code == 410 => {
            Err(WatchEnd::failed(None, format!("watch: {}; listing again", status_text(&status))))
        }
        Ok(Err(error)) => {
            Err(WatchEnd::failed(Some(version.to_owned()), format!("watch: {}", describe(&error))))
        }
        Ok(Ok(body)) => Ok(body),
    }
}

/// One line's read: its length, or how the watch ends when the stream went quiet, broke or
/// carried bytes that are not text (which loses a change, so list again).
fn bytes_read(
    read: Result<std::io::Result<usize>, tokio::time::error::Elapsed>,
    idle_cutoff: Duration,
    version: &str,
) -> Result<usize, WatchEnd> {
    match read {
        Err(_) => {
            let error = format!("watch: no event or bookmark for {}s", idle_cutoff.as_secs_f64());
            Err(WatchEnd::failed(Some(version.to_owned()), error))
        }
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::InvalidData => {
            Err(WatchEnd::failed(None, format!("watch: unreadable line ({error}); listing again")))
        }
        Ok(Err(error)) => {
            Err(WatchEnd::failed(Some(version.to_owned()), format!("watch: the stream broke: {error}")))
        }
        Ok(Ok(read)) => Ok(read),
    }
}

/// The server closed the stream: a normal end, unless it closed an empty watch at once (a server
/// that does so every time would otherwise be asked again without a pause).
fn stream_closed(lines: u64, opened: tokio::time::Instant, version: String) -> WatchEnd {
    if lines == 0 && opened.elapsed() < SHORT_WATCH {
        return WatchEnd::failed(Some(version), "watch: closed at once, with nothing in it".to_owned());
    }
    WatchEnd::Closed(version)
}

/// A line of the stream as an event; a Status line is an error event. A line that is neither
/// lost a change, so the watch ends with a list.
fn parse_event<K: DeserializeOwned>(text: &str) -> Result<WatchEvent<K>, WatchEnd> {
    match serde_json::from_str::<WatchEvent<K>>(text) {
        Ok(event) => Ok(event),
        Err(error) => match serde_json::from_str::<kube::core::Status>(text) {
            Ok(status) if status.code != 0 => Ok(WatchEvent::Error(Box::new(status))),
            _ => {
                let excerpt: String = text.chars().take(80).collect();
                let error = format!(
                    "watch: unreadable line ({error}): {excerpt:?}; listing again, as the change it carried is lost"
                );
                Err(WatchEnd::failed(None, error))
            }
        },
    }
}

/// What an event changes and the version to resume from after it, or how the watch ends.
fn event_update<K: kube::Resource, L>(
    event: WatchEvent<K>,
    version: &str,
) -> Result<(Option<Update<K, L>>, String), WatchEnd> {
    let (update, next_version) = match event {
        WatchEvent::Added(object) | WatchEvent::Modified(object) => {
            let next = object.resource_version();
            (Some(Update::Applied(object)), next)
        }
        WatchEvent::Deleted(object) => {
            let next = object.resource_version();
            (Some(Update::Deleted(object)), next)
        }
        WatchEvent::Bookmark(bookmark) => (None, Some(bookmark.metadata.resource_version)),
        WatchEvent::Error(status) if status.code == 410 => {
            return Err(WatchEnd::failed(None, format!("watch: {}; listing again", status_text(&status))));
        }
        WatchEvent::Error(status) => {
            return Err(WatchEnd::failed(
                Some(version.to_owned()),
                format!("watch: error event: {}", status_text(&status)),
            ));
        }
    };
    let Some(next_version) = next_version.filter(|v| !v.is_empty()) else {
        return Err(WatchEnd::failed(
            None,
            "watch: an event without a resourceVersion; listing again".to_owned(),
        ));
    };
    Ok((update, next_version))
}

/// `410 Gone: too old resource version: 5 (7)`.
fn status_text(status: &kube::core::Status) -> String {
    let phrase =
        hyper::StatusCode::from_u16(status.code).ok().and_then(|c| c.canonical_reason()).unwrap_or("");
    match (status.message.as_str(), phrase) {
        ("", _) => format!("{} {phrase}", status.code),
        (message, _) => format!("{} {phrase}: {message}", status.code),
    }
}

/// An API error as its Status, anything else with its causes
/// (`... tcp connect error: Connection refused (os error 111)`); doctor's API check says it too.
pub(crate) fn describe(error: &kube::Error) -> String {
    if let kube::Error::Api(status) = error {
        return status_text(status);
    }
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

use std::fs;

use super::{merge::*, watcher::*, *};
use crate::k8s::{
    api_watch::Snapshot,
    manifest::{self, ManifestError},
};

const WEB: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.100
  ports: [{name: http, port: 80, protocol: TCP}]
";

const WEB_SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11]}]
ports: [{name: http, port: 80, protocol: TCP}]
";

const DNS: &str = "apiVersion: v1
kind: Service
metadata: {name: dns, namespace: kube-system}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: dns, port: 53, protocol: UDP}]
";

fn parsed(text: &str) -> FileRead {
    Ok((Arc::from(text), manifest::parse_str(text, "f.yaml")))
}

fn merged(held: &[Entry], text: &str) -> (Vec<Entry>, Vec<ManifestError>) {
    let (entries, errors, _) = merge("f.yaml", held, parsed(text));
    (entries, errors)
}

fn described(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .map(|e| {
            format!("{} from {}{}", e.ident.label(), e.object.origin(), if e.kept { " (kept)" } else { "" })
        })
        .collect()
}

fn ports(entries: &[Entry]) -> Vec<i32> {
    entries
        .iter()
        .filter_map(|e| match &e.object {
            Object::Service(s) => Some(s.object.spec.as_ref()?.ports.as_ref()?[0].port),
            Object::Slice(_) | Object::ServiceCidr(_) => None,
        })
        .collect()
}

#[test]
fn a_clean_file_is_authoritative() {
    let (held, errors) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}---\n{DNS}"));
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(held.len(), 3);
    // The slice and the DNS Service are gone from the file: they go.
    let (now, errors) = merged(&held, WEB);
    assert!(errors.is_empty());
    assert_eq!(described(&now), ["Service default/web from f.yaml"]);
}

#[test]
fn a_document_that_does_not_parse_keeps_what_its_position_held() {
    let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}---\n{DNS}"));
    let broken = WEB.replace("name: web,", "name: [web,").replace("port: 80", "port: 8080");
    let (now, errors) = merged(&held, &format!("{broken}---\n{WEB_SLICE}---\n{}", DNS.replace("53", "54")));
    assert_eq!(
        described(&now),
        [
            "Service kube-system/dns from f.yaml (document 3)",
            "EndpointSlice default/web-1 from f.yaml (document 2)",
            "Service default/web from f.yaml (document 1) (kept)",
        ]
    );
    // The kept Service is the last good version; the DNS Service's change applies.
    assert_eq!(ports(&now), [54, 80]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    let error = errors[0].to_string();
    assert!(error.starts_with("f.yaml (document 1): Service default/web: invalid YAML: "), "{error}");
    assert!(error.ends_with("; the last good version stays programmed"), "{error}");
}

#[test]
fn a_type_error_keeps_the_named_object() {
    let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}"));
    let slice = WEB_SLICE.replace("port: 80", "port: eighty");
    let (now, errors) = merged(&held, &format!("{WEB}---\n{slice}"));
    assert_eq!(
        described(&now),
        [
            "Service default/web from f.yaml (document 1)",
            "EndpointSlice default/web-1 from f.yaml (document 2) (kept)"
        ]
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    let error = errors[0].to_string();
    assert!(
        error.starts_with("f.yaml (document 2): EndpointSlice default/web-1: ports[0].port: invalid type"),
        "{error}"
    );
    assert!(error.ends_with(KEPT), "{error}");
}

/// Documents moved, one broken and one removed in the same edit: nothing
/// the file held goes while it has errors, and the error says which
/// objects are kept; a clean read then removes what it no longer holds.
#[test]
fn a_file_with_errors_removes_nothing_and_a_clean_one_does() {
    let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}---\n{DNS}"));
    let (now, errors) = merged(&held, &format!("{DNS}---\nkind: Service\napiVersion: v1\nmetadata: [\n"));
    assert_eq!(
        described(&now),
        [
            "Service kube-system/dns from f.yaml (document 1)",
            "Service default/web from f.yaml (document 1) (kept)",
            "EndpointSlice default/web-1 from f.yaml (document 2) (kept)",
        ]
    );
    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0].starts_with("f.yaml (document 2): EndpointSlice default/web-1: invalid YAML"),
        "{errors:?}"
    );
    assert_eq!(
        errors[1],
        "f.yaml: Service default/web: not in the documents that can be read now; the last good version stays \
             programmed until the file reads without errors"
    );
    let (now, errors) = merged(&now, DNS);
    assert!(errors.is_empty());
    assert_eq!(described(&now), ["Service kube-system/dns from f.yaml"]);
    // What a clean read removed never comes back from a later broken one.
    let (now, _) = merged(&now, "kind: Service\napiVersion: v1\nmetadata: [\n");
    assert_eq!(described(&now), ["Service kube-system/dns from f.yaml (kept)"]);
}

#[test]
fn a_file_that_cannot_be_read_keeps_everything() {
    let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}"));
    let error = ManifestError::new("f.yaml", "not a regular file (a FIFO); it is not read");
    let (now, errors, text) = merge("f.yaml", &held, Err(error));
    assert!(text.is_none());
    assert_eq!(now.len(), 2);
    assert!(now.iter().all(|e| e.kept));
    assert_eq!(
        errors[0].to_string(),
        "f.yaml: Service default/web, EndpointSlice default/web-1: not a regular file (a FIFO); it is not read; \
             the last good version stays programmed"
    );
    // A new file that cannot be read names nothing it does not have.
    let (now, errors, _) = merge("f.yaml", &[], Err(ManifestError::new("f.yaml", "boom")));
    assert!(now.is_empty());
    assert_eq!(errors[0].to_string(), "f.yaml: boom");
}

#[test]
fn rewrites_caught_half_way_look_unfinished() {
    let before = format!("{WEB}---\n{WEB_SLICE}");
    let at = |text: &str| looks_unfinished(Some(&before), &parsed(text));
    assert_eq!(at(""), Some("the file is empty now"));
    assert_eq!(at(&format!("{WEB}---\n")), Some("the file is now the start of what it held"));
    assert_eq!(at(&before[..before.len() - 10]), Some("the file is now the start of what it held"));
    assert_eq!(at(&WEB.replace("80", "8080")[..WEB.len()]), Some("the file ends in the middle of a line"));
    assert_eq!(at(&before), None);
    assert_eq!(at(&format!("{before}---\n{DNS}")), None);
    assert_eq!(at(DNS), None);
    assert_eq!(looks_unfinished(None, &parsed("")), None);
    assert_eq!(looks_unfinished(Some("a: 1"), &parsed("a: 2")), None);
}

#[test]
fn documents_named_by_origins() {
    assert_eq!(document_of("f.yaml", "f.yaml"), Some(1));
    assert_eq!(document_of("f.yaml (items[2])", "f.yaml"), Some(1));
    assert_eq!(document_of("f.yaml (document 12)", "f.yaml"), Some(12));
    assert_eq!(document_of("f.yaml (document 3, items[0])", "f.yaml"), Some(3));
    assert_eq!(document_of("g.yaml (document 3)", "f.yaml"), None);
}

use crate::testutil::TempDir;

/// Polls with a clock the test moves.
struct Clock {
    watcher: Watcher,
    now: Instant,
    progress: Progress,
}

impl Clock {
    fn new(root: &Path) -> Self {
        Clock {
            watcher: Watcher::new(root.to_path_buf()),
            now: Instant::now(),
            progress: Progress::default(),
        }
    }

    fn poll(&mut self) -> Option<Snapshot> {
        self.now += Duration::from_millis(250);
        self.watcher.poll(self.now, &self.progress)
    }

    /// Polls until a snapshot comes (at most `polls` times).
    fn next(&mut self, polls: usize) -> Option<Snapshot> {
        (0..polls).find_map(|_| self.poll())
    }
}

fn names(snapshot: &Snapshot) -> Vec<String> {
    let services = snapshot
        .services()
        .into_iter()
        .map(|s| format!("Service {}", s.object.metadata.name.as_deref().unwrap()));
    let slices = snapshot
        .slices()
        .into_iter()
        .map(|s| format!("EndpointSlice {}", s.object.metadata.name.as_deref().unwrap()));
    services.chain(slices).collect()
}

#[test]
fn files_are_read_once_they_look_the_same_twice() {
    let tmp = TempDir::new("debounce");
    fs::write(tmp.0.join("web.yaml"), format!("{WEB}---\n{WEB_SLICE}")).unwrap();
    let mut clock = Clock::new(&tmp.0);
    assert!(clock.poll().is_none(), "read at the first sight");
    let snapshot = clock.poll().expect("read at the second");
    assert_eq!(names(&snapshot), ["Service web", "EndpointSlice web-1"]);
    assert!(clock.poll().is_none(), "nothing changed");
    fs::write(tmp.0.join("dns.yaml"), DNS).unwrap();
    assert!(clock.poll().is_none(), "a new file waits a poll");
    assert_eq!(names(&clock.poll().unwrap()), ["Service web", "Service dns", "EndpointSlice web-1"]);
    // A removed file goes once it has been missing twice.
    fs::remove_file(tmp.0.join("dns.yaml")).unwrap();
    assert!(clock.poll().is_none());
    assert_eq!(names(&clock.poll().unwrap()), ["Service web", "EndpointSlice web-1"]);
}

#[test]
fn an_empty_directory_is_ready_after_a_poll() {
    let tmp = TempDir::new("empty");
    let mut clock = Clock::new(&tmp.0);
    assert!(clock.poll().is_none());
    assert!(names(&clock.poll().expect("an empty snapshot, so the agent is ready")).is_empty());
}

#[test]
fn a_vanished_directory_changes_nothing() {
    let tmp = TempDir::new("vanish");
    let dir = tmp.0.join("manifests");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("web.yaml"), format!("{WEB}---\n{WEB_SLICE}")).unwrap();
    let mut clock = Clock::new(&dir);
    assert_eq!(names(&clock.next(2).unwrap()).len(), 2);
    fs::rename(&dir, tmp.0.join("moved")).unwrap();
    for _ in 0..4 {
        assert!(clock.poll().is_none());
    }
    assert_eq!(clock.watcher.state, ManifestState { objects_kept: 2, errors: 1 });
    // Back with a change: applied once seen twice.
    fs::rename(tmp.0.join("moved"), &dir).unwrap();
    fs::write(dir.join("web.yaml"), DNS).unwrap();
    assert!(clock.poll().is_none());
    assert_eq!(names(&clock.poll().unwrap()), ["Service dns"]);
    assert_eq!(clock.watcher.state, ManifestState::default());
}

#[test]
fn a_file_cut_short_is_held_until_it_settles() {
    let tmp = TempDir::new("settle");
    let file = tmp.0.join("web.yaml");
    fs::write(&file, format!("{WEB}---\n{WEB_SLICE}")).unwrap();
    let mut clock = Clock::new(&tmp.0);
    assert_eq!(names(&clock.next(2).unwrap()).len(), 2);
    // The first of two writes: the Service alone.
    fs::write(&file, format!("{WEB}---\n")).unwrap();
    for _ in 0..8 {
        assert!(clock.poll().is_none(), "applied before it settled");
    }
    // The second write comes: nothing changes for the model.
    fs::write(&file, format!("{WEB}---\n{WEB_SLICE}")).unwrap();
    let snapshot = clock.next(30);
    assert!(snapshot.is_none_or(|s| names(&s).len() == 2));
    // Cut short for good: applied after SETTLE.
    fs::write(&file, format!("{WEB}---\n")).unwrap();
    let started = clock.now;
    let snapshot = clock.next(40).expect("applied once settled");
    assert!(clock.now - started >= SETTLE);
    assert_eq!(names(&snapshot), ["Service web"]);
}

#[test]
fn errors_name_special_files_and_keep_what_they_held() {
    let tmp = TempDir::new("fifo");
    let file = tmp.0.join("web.yaml");
    fs::write(&file, format!("{WEB}---\n{WEB_SLICE}")).unwrap();
    let mut clock = Clock::new(&tmp.0);
    assert_eq!(names(&clock.next(2).unwrap()).len(), 2);
    fs::remove_file(&file).unwrap();
    let c_path = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    let snapshot = clock.next(3).unwrap();
    assert_eq!(names(&snapshot), ["Service web", "EndpointSlice web-1"]);
    assert_eq!(
        snapshot.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
        [format!(
            "{}: Service default/web, EndpointSlice default/web-1: not a regular file (a FIFO); it is not read; {KEPT}",
            file.display()
        )]
    );
    assert_eq!(clock.watcher.state, ManifestState { objects_kept: 2, errors: 1 });
}

/// A newcomer that claims a running Service's ClusterIP (in a file that
/// sorts first, with a name that sorts first, or as a second copy of the
/// Service) comes after it; once the holder goes, the newcomer has it.
#[test]
fn an_address_stays_with_the_service_that_held_it() {
    let tmp = TempDir::new("claims");
    fs::write(tmp.0.join("web.yaml"), format!("{WEB}---\n{WEB_SLICE}")).unwrap();
    let mut clock = Clock::new(&tmp.0);
    clock.next(2).unwrap();
    let thief = WEB.replace("name: web,", "name: aaa,");
    let copy = WEB.replace("port: 80", "port: 80, targetPort: 8080");
    fs::write(tmp.0.join("00-new.yaml"), format!("{thief}---\n{copy}")).unwrap();
    let snapshot = clock.next(2).unwrap();
    let holder = |snapshot: &Snapshot| {
        let options = crate::model::ModelOptions::default();
        let (desired, errors) = crate::model::build_with(&snapshot.services(), &snapshot.slices(), &options);
        let frontend = desired.frontends.iter().find(|f| f.port == 80).unwrap();
        (frontend.service.to_string(), errors.iter().map(ToString::to_string).collect::<Vec<_>>())
    };
    let (service, errors) = holder(&snapshot);
    assert_eq!(service, "default/web");
    let web_file = tmp.0.join("web.yaml").display().to_string();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("Service default/aaa") && e.contains("already used by Service default/web")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains(&format!("defined again (first in {web_file} (document 1))"))),
        "{errors:?}"
    );
    fs::remove_file(tmp.0.join("web.yaml")).unwrap();
    let snapshot = clock.next(2).unwrap();
    assert_eq!(holder(&snapshot).0, "default/aaa");
}

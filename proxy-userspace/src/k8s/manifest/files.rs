//! Finding and reading manifest files: a path's files (a directory walked for `*.yaml`, `*.yml` and `*.json`,
//! link loops and hidden entries skipped), each read without ever blocking and within [`MAX_FILE_BYTES`].

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::{ManifestError, Objects, parse_str};

/// File name endings that are read when walking a directory.
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// A larger file is reported, not read: Services and EndpointSlices for a large cluster fit many times over.
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// The files a manifests path names: the path itself when it is not a directory, else every `*.yaml`, `*.yml` and
/// `*.json` below it, sorted by path, each with what `stat` (following links) said of it.
#[derive(Debug, Default)]
pub struct Listing {
    pub files: Vec<(PathBuf, fs::Metadata)>,
    /// Directories and entries below the path that could not be read: what they hold is unknown.
    pub unreadable: Vec<(PathBuf, ManifestError)>,
}

/// Reads a file, or every `*.yaml`, `*.yml` and `*.json` below a directory (recursively, sorted by path).
///
/// An explicitly named file is read whatever its name. Entries whose name starts with `.` are skipped while
/// walking, which also keeps the `..data` / `..2025_01_01...` directories of a mounted ConfigMap from being
/// read a second time. An unreadable path becomes an error in [`Objects::errors`].
pub fn load_path(path: &Path) -> Objects {
    let mut out = Objects::default();
    let listing = match list_path(path) {
        Ok(listing) => listing,
        Err(err) => {
            out.errors.push(err);
            return out;
        }
    };
    out.errors.extend(listing.unreadable.into_iter().map(|(_, err)| err));
    for (file, _) in listing.files {
        out.append(load_file(&file));
    }
    out
}

/// What [`load_path`] reads, without reading it. An error when the path itself cannot be read.
pub fn list_path(path: &Path) -> Result<Listing, ManifestError> {
    let meta =
        fs::metadata(path).map_err(|err| ManifestError::new(path.display().to_string(), err.to_string()))?;
    let mut listing = Listing::default();
    if !meta.is_dir() {
        listing.files.push((path.to_path_buf(), meta));
        return Ok(listing);
    }
    // The path itself must be listable: a directory that cannot be read says nothing about what it holds.
    fs::read_dir(path).map_err(|err| ManifestError::new(path.display().to_string(), err.to_string()))?;
    let mut visited = HashSet::new();
    collect_files(path, &mut listing, &mut visited);
    listing.files.sort_by(|a, b| a.0.cmp(&b.0));
    listing.files.dedup_by(|a, b| a.0 == b.0);
    Ok(listing)
}

/// Reads and parses one file (see [`read_file`] and [`parse_str`]).
pub fn load_file(path: &Path) -> Objects {
    match read_file(path) {
        Ok(text) => parse_str(&text, &path.display().to_string()),
        Err(err) => Objects { errors: vec![err], ..Default::default() },
    }
}

/// A file's text, read without ever blocking: only a regular file is opened (a FIFO, socket or device named
/// `*.yaml` is an error naming it), with `O_NONBLOCK` so that one swapped in after the check cannot hold `open()`,
/// and checked again on the open descriptor; at most [`MAX_FILE_BYTES`]; UTF-8.
pub fn read_file(path: &Path) -> Result<String, ManifestError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;

    let error = |message: String| ManifestError::new(path.display().to_string(), message);
    let check = |meta: &fs::Metadata| -> Result<(), ManifestError> {
        if let Some(kind) = not_regular(meta) {
            return Err(error(format!("not a regular file ({kind}); it is not read")));
        }
        if meta.len() > MAX_FILE_BYTES {
            let message =
                format!("{} bytes, over the limit of {MAX_FILE_BYTES} bytes; it is not read", meta.len());
            return Err(error(message));
        }
        Ok(())
    };
    check(&fs::metadata(path).map_err(|err| error(err.to_string()))?)?;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|err| error(err.to_string()))?;
    let meta = file.metadata().map_err(|err| error(err.to_string()))?;
    check(&meta)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|err| error(err.to_string()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(error(format!(
            "grew over the limit of {MAX_FILE_BYTES} bytes while being read; it is not read"
        )));
    }
    String::from_utf8(bytes).map_err(|err| error(format!("not UTF-8 text: {err}")))
}

/// What a file that is not a regular file is, for messages.
fn not_regular(meta: &fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt as _;
    let kind = meta.file_type();
    match () {
        _ if kind.is_file() => None,
        _ if kind.is_dir() => Some("a directory"),
        _ if kind.is_fifo() => Some("a FIFO"),
        _ if kind.is_socket() => Some("a socket"),
        _ if kind.is_char_device() => Some("a character device"),
        _ if kind.is_block_device() => Some("a block device"),
        _ => Some("not a file"),
    }
}

fn collect_files(dir: &Path, listing: &mut Listing, visited: &mut HashSet<PathBuf>) {
    // Symbolic links are followed; remembering canonical directories stops link loops.
    let canonical = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    if !visited.insert(canonical) {
        return;
    }
    let unreadable = |path: &Path, err: std::io::Error| {
        (path.to_path_buf(), ManifestError::new(path.display().to_string(), err.to_string()))
    };
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) => {
            listing.unreadable.push(unreadable(dir, err));
            return;
        }
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(err) => {
                listing.unreadable.push(unreadable(dir, err));
                continue;
            }
        };
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let meta = match fs::metadata(&path) {
            Ok(meta) => meta,
            Err(err) => {
                // A dangling link may stand for a directory or a manifest; a stray file is not worth a word.
                if has_manifest_extension(&path)
                    || entry.file_type().is_ok_and(|t| t.is_dir() || t.is_symlink())
                {
                    listing.unreadable.push(unreadable(&path, err));
                }
                continue;
            }
        };
        if meta.is_dir() {
            collect_files(&path, listing, visited);
        } else if has_manifest_extension(&path) {
            listing.files.push((path, meta));
        }
    }
}

fn has_manifest_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|ext| ext.to_str())
        .is_some_and(|ext| EXTENSIONS.iter().any(|known| ext.eq_ignore_ascii_case(known)))
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{KUBE_DNS, KUBE_DNS_SLICE, names};
    use super::*;
    use crate::testutil::TempDir;

    #[test]
    fn load_directory_recursively_sorted_by_path() {
        let tmp = TempDir::new("dir");
        let root = &tmp.0;
        fs::create_dir_all(root.join("b/nested")).unwrap();
        fs::create_dir_all(root.join("..data")).unwrap();
        fs::write(root.join("b/nested/z.yml"), KUBE_DNS_SLICE).unwrap();
        fs::write(root.join("a.yaml"), KUBE_DNS.replace("kube-dns\n  namespace", "a\n  namespace")).unwrap();
        fs::write(root.join("b/c.json"), r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"}}"#)
            .unwrap();
        fs::write(root.join("b/readme.md"), "kind: Service\n").unwrap();
        fs::write(root.join("..data/a.yaml"), KUBE_DNS).unwrap();
        fs::write(root.join(".hidden.yaml"), KUBE_DNS).unwrap();
        fs::write(root.join("bad.YAML"), "kind: Service\napiVersion: v1\nmetadata: {name: [x\n").unwrap();

        let objects = load_path(root);
        assert_eq!(
            names(&objects),
            ["Service kube-system/a", "Service /c", "Slice kube-system/kube-dns-abc12"]
        );
        assert_eq!(objects.services[0].origin, root.join("a.yaml").display().to_string());
        assert_eq!(objects.services[1].origin, root.join("b/c.json").display().to_string());
        assert_eq!(objects.slices[0].origin, root.join("b/nested/z.yml").display().to_string());
        assert_eq!(objects.errors.len(), 1, "{:?}", objects.errors);
        assert_eq!(objects.errors[0].origin, root.join("bad.YAML").display().to_string());

        // A file named explicitly is read whatever its extension.
        let objects = load_path(&root.join("b/readme.md"));
        assert_eq!(objects.services.len(), 1);
        assert!(objects.errors.is_empty());
        let objects = load_path(&root.join("b/nested/z.yml"));
        assert_eq!(objects.slices.len(), 1);
    }

    #[test]
    fn unreadable_paths_are_errors() {
        let tmp = TempDir::new("missing");
        let missing = tmp.0.join("does-not-exist.yaml");
        let objects = load_path(&missing);
        assert_eq!(objects.errors.len(), 1);
        assert_eq!(objects.errors[0].origin, missing.display().to_string());
        assert!(objects.services.is_empty());

        let binary = tmp.0.join("binary.yaml");
        fs::write(&binary, [0xff, 0xfe, 0x00, 0x41]).unwrap();
        let objects = load_path(&binary);
        assert_eq!(objects.errors.len(), 1);
        assert!(objects.errors[0].message.starts_with("not UTF-8"), "{}", objects.errors[0].message);
    }

    #[cfg(unix)]
    #[test]
    fn symlink_loops_terminate() {
        let tmp = TempDir::new("loop");
        fs::create_dir_all(tmp.0.join("sub")).unwrap();
        std::os::unix::fs::symlink(&tmp.0, tmp.0.join("sub/back")).unwrap();
        fs::write(tmp.0.join("sub/svc.yaml"), KUBE_DNS).unwrap();
        let objects = load_path(&tmp.0);
        assert_eq!(objects.services.len(), 1);
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
    }

    /// `kproxy agent` must never block on what a directory holds: a FIFO named `*.yaml` (which blocks `open()`
    /// for reading until a writer comes) and a socket are errors naming them, found without opening them for
    /// good.
    #[test]
    fn special_files_are_errors_and_never_block() {
        let tmp = TempDir::new("special");
        let fifo = tmp.0.join("fifo.yaml");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
        let socket = tmp.0.join("socket.yaml");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        fs::write(tmp.0.join("web.yaml"), KUBE_DNS).unwrap();

        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let root = tmp.0.clone();
        std::thread::spawn(move || done_tx.send(load_path(&root)).unwrap());
        let objects = done_rx.recv_timeout(std::time::Duration::from_secs(10)).expect("load_path blocked");
        assert_eq!(names(&objects), ["Service kube-system/kube-dns"]);
        let errors: Vec<String> = objects.errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            errors,
            [
                format!("{}: not a regular file (a FIFO); it is not read", fifo.display()),
                format!("{}: not a regular file (a socket); it is not read", socket.display()),
            ]
        );
        // Named explicitly, the same.
        assert_eq!(load_path(&fifo).errors.len(), 1);
    }

    #[test]
    fn files_over_the_size_limit_are_errors() {
        let tmp = TempDir::new("large");
        let large = tmp.0.join("large.yaml");
        fs::File::create(&large).unwrap().set_len(MAX_FILE_BYTES + 1).unwrap();
        let err = read_file(&large).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: 4194305 bytes, over the limit of 4194304 bytes; it is not read", large.display())
        );
        fs::File::create(&large).unwrap().set_len(MAX_FILE_BYTES).unwrap();
        // At the limit it is read (and, being NUL bytes, is not a manifest).
        assert!(read_file(&large).is_ok());
    }
}

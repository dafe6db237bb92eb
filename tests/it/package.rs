//! What the published package holds is enough for its own docs: every
//! relative link in a Markdown file it ships (the README, `docs/`, the
//! changelog, the benchmarks) names a file it ships too, so no link goes
//! nowhere on crates.io or in a downloaded crate.

use std::path::{Component, Path, PathBuf};

/// The package's `include` list from `Cargo.toml`, as paths from the root:
/// a directory's whole tree (`/docs/**/*`) or one file.
fn included() -> Vec<String> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let list = manifest
        .split("include = [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("Cargo.toml lists what the package includes");
    list.lines()
        .filter_map(|line| line.trim().strip_prefix("\"/")?.strip_suffix("\","))
        .map(str::to_owned)
        .collect()
}

/// The repository's root, where the library's package is.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn ships(included: &[String], path: &Path) -> bool {
    let path = path.to_string_lossy();
    included
        .iter()
        .any(|pattern| match pattern.strip_suffix("/**/*") {
            Some(tree) => path.starts_with(&format!("{tree}/")),
            None => *pattern == path,
        })
}

/// `target`, a link from the file at `from`, as a path from the root;
/// `None` for a link off the package (a URL, an anchor in the same file).
fn resolved(from: &Path, target: &str) -> Option<PathBuf> {
    let target = target.split('#').next()?;
    if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let mut path = from.parent().unwrap_or(Path::new("")).to_path_buf();
    for part in Path::new(target).components() {
        match part {
            Component::ParentDir => {
                path.pop();
            }
            Component::Normal(name) => path.push(name),
            _ => {}
        }
    }
    Some(path)
}

/// The targets of the inline links `[text](target)` in `text`.
fn links(text: &str) -> Vec<&str> {
    text.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &text[at + 2..];
            rest.find(')').map(|end| &rest[..end])
        })
        .filter(|target| !target.contains(' '))
        .collect()
}

#[test]
fn every_relative_link_of_the_packaged_docs_names_a_packaged_file() {
    let included = included();
    let mut markdown = vec![PathBuf::from("README.md"), PathBuf::from("CHANGELOG.md")];
    markdown.push(PathBuf::from("BENCHMARKS.md"));
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "md") {
            markdown.push(path.strip_prefix(root()).unwrap().to_path_buf());
        }
    }
    let mut broken = Vec::new();
    for file in &markdown {
        assert!(
            ships(&included, file),
            "{} is not in the package",
            file.display()
        );
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for target in links(&text) {
            let Some(path) = resolved(file, target) else {
                continue;
            };
            if !ships(&included, &path) || !root().join(&path).exists() {
                broken.push(format!("{}: {target}", file.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links the package leaves out: {broken:#?}"
    );
}

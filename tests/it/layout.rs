//! The crate's layout: no two of its top-level modules import each other,
//! directly or through others (`crate::` paths in code, comments and test
//! modules left out), so that each can be read, and changed, below the
//! ones that use it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The top-level modules each top-level module's code names.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../src");
    let mut tops = BTreeSet::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if name != "lib" {
            tops.insert(name);
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![src.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap();
            let top = relative
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy();
            let top = top.trim_end_matches(".rs").to_owned();
            let in_tests = relative
                .components()
                .any(|part| part.as_os_str() == "tests")
                || relative.file_name().is_some_and(|name| name == "tests.rs");
            if top == "lib" || in_tests || path.extension().is_none_or(|ext| ext != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or(&text);
            for line in code
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
            {
                for (at, _) in line.match_indices("crate::") {
                    let name: String = line[at + 7..]
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if tops.contains(&name) && name != top {
                        edges.entry(top.clone()).or_default().insert(name);
                    }
                }
            }
        }
    }
    edges
}

/// Whether `to` reaches `from` back through `edges`.
fn reaches(edges: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut pending = vec![to.to_owned()];
    while let Some(module) = pending.pop() {
        if module == from {
            return true;
        }
        if seen.insert(module.clone()) {
            pending.extend(edges.get(&module).into_iter().flatten().cloned());
        }
    }
    false
}

#[test]
fn no_top_level_module_imports_one_that_imports_it() {
    let edges = imports();
    for (module, names) in &edges {
        println!(
            "{module} -> {}",
            names.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    assert!(edges.len() > 5, "the layout was read: {edges:?}");
    let cycles: Vec<String> = edges
        .iter()
        .flat_map(|(module, names)| {
            names
                .iter()
                .filter(|name| reaches(&edges, module, name))
                .map(move |name| format!("{module} -> {name}"))
        })
        .collect();
    assert!(cycles.is_empty(), "imports that come back: {cycles:?}");
}

/// Every module of this binary is in `tests/README.md`'s table, so a
/// reader looking for what a test shows finds it there.
#[test]
fn every_module_of_the_tests_is_in_the_readme() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    let main = std::fs::read_to_string(tests.join("it/main.rs")).unwrap();
    let readme = std::fs::read_to_string(tests.join("README.md")).unwrap();
    let missing: Vec<&str> = main
        .lines()
        .filter_map(|line| line.strip_prefix("mod ")?.strip_suffix(';'))
        .filter(|module| *module != "support")
        .filter(|module| !readme.contains(&format!("| `{module}` |")))
        .collect();
    assert!(missing.is_empty(), "not in tests/README.md: {missing:?}");
}

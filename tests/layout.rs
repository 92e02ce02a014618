//! The layout stays one a reader can find their way in: `scripts/module-graph.py --check` finds no import
//! circle among sibling modules, no arrow against the data-flow order of docs/ARCHITECTURE.md, and no file
//! over its size (600 lines, 1,200 in src/kernels).

use std::process::Command;

fn module_graph(args: &[&str]) -> std::process::Output {
    Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/module-graph.py"))
        .args(args)
        .output()
        .expect("python3 runs scripts/module-graph.py (install python3)")
}

#[test]
fn no_import_circle_no_arrow_back_up_no_oversized_file() {
    let out = module_graph(&["--check"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The check sees the arrows: the printed graph has the library's known ones and none back up.
#[test]
fn the_graph_holds_the_known_arrows() {
    let out = module_graph(&[]);
    let graph = String::from_utf8_lossy(&out.stdout);
    let arrows = |from: &str| {
        graph
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{from} -> ")))
            .unwrap_or_else(|| panic!("no arrows from {from} in:\n{graph}"))
            .split(", ")
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert!(arrows("model").contains(&"kernels".to_string()));
    assert!(arrows("cli").contains(&"serve".to_string()));
    assert!(!arrows("serve").contains(&"cli".to_string()));
    assert!(!arrows("decode").iter().any(|m| m == "bench" || m == "session"));
}

/// The check can fail: a tree with two sibling modules naming each other, an arrow back up, and an
/// oversized file is refused, each named.
#[test]
fn circles_arrows_back_up_and_long_files_are_refused() {
    let src = tempfile::tempdir().unwrap();
    let write = |rel: &str, text: &str| {
        let path = src.path().join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "pub mod model;\npub mod decode;\n");
    write(
        "model/mod.rs",
        "pub mod gguf;\npub mod load;\nuse crate::decode::x;\n",
    );
    write("model/gguf.rs", "use super::load::Options;\n");
    write("model/load.rs", "use super::gguf::read;\n");
    write("decode/mod.rs", &"// line\n".repeat(601));
    let out = module_graph(&["--check", "--src", src.path().to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("circle among the children of model: gguf -> load -> gguf"),
        "{said}"
    );
    assert!(said.contains("arrow back up: model -> decode"), "{said}");
    assert!(said.contains("src/decode/mod.rs: 601 lines"), "{said}");
}

//! The flag table of `meshca serve` (docs/flags.md, "`meshca serve`
//! flags", linked from the README) against what the binary prints:
//! every long flag of
//! `meshca serve --help` is a row of one contiguous markdown table, and
//! every row of that table is a flag the binary has. A blank line inside
//! the table ends it, and the rows after it render as a paragraph of
//! pipes: this test fails then.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// The long flags `meshca serve --help` lists (its option lines, not the
/// flags its descriptions mention), without `--help` itself.
fn flags_in_help() -> BTreeSet<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["serve", "--help"])
        .output()
        .expect("runs meshca");
    assert!(output.status.success(), "meshca serve --help failed");
    let help = String::from_utf8(output.stdout).expect("UTF-8 help");
    let flags: BTreeSet<String> = help
        .lines()
        .filter_map(|line| {
            // Option lines are indented 2 (`-h, --help`) or 6 (`--flag`)
            // spaces; their wrapped descriptions are indented further.
            let indent = line.len() - line.trim_start().len();
            let option = line.trim_start();
            if indent > 6 || !option.starts_with('-') {
                return None;
            }
            let long = &option[option.find("--")?..];
            let end = long
                .find(|c: char| !(c == '-' || c.is_ascii_alphanumeric()))
                .unwrap_or(long.len());
            Some(long[..end].to_string())
        })
        .filter(|flag| flag != "--help")
        .collect();
    assert!(
        flags.len() > 30 && flags.contains("--listen"),
        "the help's option lines were not recognised: {flags:?}"
    );
    flags
}

/// The blocks of consecutive lines that start with `|` (markdown tables),
/// with the line number of their first line.
fn tables(markdown: &str) -> Vec<(usize, Vec<&str>)> {
    let mut tables = Vec::new();
    let mut current: Option<(usize, Vec<&str>)> = None;
    for (n, line) in markdown.lines().enumerate() {
        if line.trim_start().starts_with('|') {
            current
                .get_or_insert_with(|| (n + 1, Vec::new()))
                .1
                .push(line);
        } else if let Some(table) = current.take() {
            tables.push(table);
        }
    }
    tables.extend(current);
    tables
}

/// The flag a table row documents: its first cell, when that starts with
/// `` `--flag``.
fn row_flag(row: &str) -> Option<String> {
    let cell = row.trim_start().strip_prefix('|')?.trim_start();
    let flag = cell.strip_prefix('`')?;
    if !flag.starts_with("--") {
        return None;
    }
    let end = flag
        .find(|c: char| !(c == '-' || c.is_ascii_alphanumeric()))
        .unwrap_or(flag.len());
    Some(flag[..end].to_string())
}

#[test]
fn every_serve_flag_is_a_row_of_one_contiguous_readme_table() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/flags.md"))
            .expect("docs/flags.md");
    let help = flags_in_help();

    let tables = tables(&readme);
    // The table that documents `--listen` is the flag table.
    let (start, rows) = tables
        .iter()
        .find(|(_, rows)| {
            rows.iter()
                .any(|r| row_flag(r).as_deref() == Some("--listen"))
        })
        .expect("a docs/flags.md table with a `--listen` row");
    assert!(
        rows.len() >= 2
            && rows[0].contains("flag")
            && rows[1].replace(['|', '-', ' ', ':'], "").is_empty(),
        "the flag table at docs/flags.md:{start} starts with a header and a separator row"
    );
    for (i, row) in rows.iter().enumerate() {
        assert!(
            row.trim_end().ends_with('|'),
            "docs/flags.md:{}: a row of the flag table ends with `|`",
            start + i
        );
    }
    let in_table: BTreeSet<String> = rows.iter().filter_map(|r| row_flag(r)).collect();

    // A serve flag documented as a row of any other table (or of a
    // second piece of the flag table cut off by a blank line).
    let elsewhere: Vec<String> = tables
        .iter()
        .filter(|(other, _)| other != start)
        .flat_map(|(at, rows)| {
            rows.iter()
                .filter_map(|r| row_flag(r))
                .filter(|f| help.contains(f) && !in_table.contains(f))
                .map(move |f| format!("{f} (docs/flags.md:{at})"))
        })
        .collect();
    let missing: Vec<&String> = help.difference(&in_table).collect();
    assert!(
        missing.is_empty(),
        "flags of `meshca serve --help` not in the flag table \
         (docs/flags.md:{start}): {missing:?}; rows of another table: {elsewhere:?}"
    );
    let unknown: Vec<&String> = in_table.difference(&help).collect();
    assert!(
        unknown.is_empty(),
        "rows of the flag table that `meshca serve --help` does not list: {unknown:?}"
    );
}

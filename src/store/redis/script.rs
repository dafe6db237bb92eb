//! The check library's source, joined from the files of `lua/`, and the
//! places in those files that Redis's error messages point at.
//!
//! Redis names a line of the source it ran (`on @user_function:812`, or
//! `@user_script:812` for `EVALSHA`); [`annotate`] adds the file, the
//! line in it and the Lua function that holds it, so that an error reads
//! `... (lua/log.lua:96, in log_read)`.

use std::fmt;
use std::sync::OnceLock;

/// The library's files, in the order they are joined: each a path from
/// the crate's root and its text.
const FILES: [(&str, &str); 9] = include!("../../../lua/files.rs");

/// The whole source: `FILES` joined, opening with the first file's
/// `#!lua` and ending with the driver's `return main(KEYS, ARGV)`.
pub(super) fn source() -> &'static str {
    static SOURCE: OnceLock<String> = OnceLock::new();
    SOURCE.get_or_init(|| FILES.iter().map(|(_, text)| *text).collect())
}

/// A line of one of the library's files.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Place {
    file: &'static str,
    /// From 1, as editors count.
    line: usize,
    /// The top-level Lua function the line lies in, if any.
    function: Option<&'static str>,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)?;
        if let Some(function) = self.function {
            write!(f, ", in {function}")?;
        }
        Ok(())
    }
}

/// Where line `line` (from 1) of the joined source lies.
pub(super) fn place(line: usize) -> Option<Place> {
    let mut first = 1;
    for (file, text) in FILES {
        let lines: Vec<&'static str> = text.lines().collect();
        if line < first + lines.len() {
            let index = line.checked_sub(first)?;
            // The nearest function opened above, unless one closed since:
            // a line between two functions is in none.
            let function = lines[..=index]
                .iter()
                .rev()
                .take_while(|l| **l != "end")
                .find_map(|l| defines(l));
            return Some(Place {
                file,
                line: index + 1,
                function,
            });
        }
        first += lines.len();
    }
    None
}

/// The name of the function a line of Lua opens at the top level, if it
/// opens one.
fn defines(line: &str) -> Option<&str> {
    if let Some(rest) = line
        .strip_prefix("local function ")
        .or_else(|| line.strip_prefix("function "))
    {
        return rest.split('(').next();
    }
    let (name, _) = line.split_once(" = function(")?;
    (!name.starts_with(' ')).then_some(name)
}

/// `message`, an error Redis returned from the library, with the place in
/// `lua/` of the line it names, if it names one.
pub(super) fn annotate(message: &str) -> Option<String> {
    let line = ["@user_function:", "@user_script:"]
        .iter()
        .find_map(|marker| {
            let at = message.rfind(marker)? + marker.len();
            let digits = message[at..].split(|c: char| !c.is_ascii_digit()).next()?;
            digits.parse().ok()
        })?;
    Some(format!("{message} ({})", place(line)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line of the joined source that holds `needle` (from 1).
    fn line_of(needle: &str) -> usize {
        source()
            .lines()
            .position(|line| line.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in the library"))
            + 1
    }

    #[test]
    fn the_source_opens_and_ends_as_a_script_does() {
        assert!(source().starts_with("#!lua\n"));
        assert!(source().ends_with("\nreturn main(KEYS, ARGV)\n"));
        for (file, text) in FILES {
            assert!(text.ends_with('\n'), "{file} ends with a newline");
        }
    }

    #[test]
    fn a_line_of_the_source_is_placed_in_its_file_and_function() {
        let line = line_of("header = redis.call('GETRANGE', s.key, 0, LOG_HEADER_SIZE - 1)");
        let read = place(line).unwrap();
        assert_eq!(read.file, "lua/log.lua");
        assert_eq!(read.function, Some("log_read"));
        let text = FILES[2].1;
        assert!(
            text.lines()
                .nth(read.line - 1)
                .unwrap()
                .contains("GETRANGE"),
            "{read}"
        );
        assert_eq!(place(1).unwrap().file, "lua/shared.lua");
        let between = place(line_of("local ARGS = 8")).unwrap();
        assert_eq!((between.file, between.function), ("lua/driver.lua", None));
        let recover = place(line_of("local tail = page(s, s.tail_page)")).unwrap();
        assert_eq!(recover.function, Some("log_recover"));
        assert_eq!(place(0), None);
        assert_eq!(place(source().lines().count() + 1), None);
        let last = place(source().lines().count()).unwrap();
        assert_eq!(last.file, "lua/driver.lua");
    }

    #[test]
    fn an_error_naming_a_line_is_given_its_place() {
        let line = line_of("function counter.prepare(s)") + 1;
        let message =
            format!("WRONGTYPE Operation against a key script: f, on @user_function:{line}.");
        assert_eq!(
            annotate(&message).unwrap(),
            format!(
                "{message} (lua/counter.lua:{}, in counter.prepare)",
                place(line).unwrap().line
            )
        );
        assert!(annotate("ERR something else").is_none());
        assert!(annotate("ERR on @user_script:999999.").is_none());
    }
}

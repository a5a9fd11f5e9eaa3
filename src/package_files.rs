//! Man pages and shell completions, generated from the clap definitions
//! (`clap_mangen`, `clap_complete`) by the hidden `mlxcel package-files DIR`
//! command that packaging runs after the build (`debian/rules`): they can
//! never disagree with the flags the binaries parse.
//!
//! Layout under `DIR`: `man/man1/<page>.1` (one page per command and
//! subcommand: `mlxcel.1`, `mlxcel-generate.1`, `mlxcel-serve.1`,
//! `mlxcel-server.1`), `bash/<command>`, `zsh/_<command>`,
//! `fish/<command>.fish` — the file names each shell's completion
//! directory expects.

use std::io::Write;
use std::path::{Path, PathBuf};

use roff::{bold, roman, Roff};

/// Writes the man pages and completions of `commands` (each a binary's
/// whole command) under `dir`; returns the files written.
pub fn write(dir: &Path, commands: &[clap::Command]) -> std::io::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let man_dir = dir.join("man").join("man1");
    std::fs::create_dir_all(&man_dir)?;
    for command in commands {
        let mut command = command.clone().disable_help_subcommand(true);
        command.build();
        written.extend(man_pages(&command, &man_dir)?);
        written.extend(completions(&command, dir)?);
    }
    Ok(written)
}

/// One page for `command` and one for each visible subcommand, named
/// `<parent>-<sub>.1`.
fn man_pages(command: &clap::Command, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        written.extend(man_pages(sub, dir)?);
    }
    let page = clap_mangen::Man::new(command.clone()).manual("mlxcel manual");
    let mut text = Vec::new();
    page.render(&mut text)?;
    let mut text = String::from_utf8_lossy(&text).into_owned();
    if serves(command) {
        // Before VERSION, without the second copy of the preamble that
        // defines the apostrophe string.
        let extra: String = server_sections()
            .render()
            .lines()
            .skip_while(|l| l.starts_with(".ie ") || l.starts_with(".el "))
            .map(|l| format!("{l}\n"))
            .collect();
        let at = text.find("\n.SH VERSION").map_or(text.len(), |i| i + 1);
        text.insert_str(at, &extra);
    }
    let path = dir.join(page.get_filename());
    std::fs::write(&path, text)?;
    written.push(path);
    Ok(written)
}

/// Whether `command` runs the server (it takes `--config`).
fn serves(command: &clap::Command) -> bool {
    command
        .get_arguments()
        .any(|a| a.get_long() == Some(crate::config::CONFIG_FLAG))
}

/// What a server's page says beyond its flags: the config file, the
/// environment, signals and exit status, the packaged files.
fn server_sections() -> Roff {
    let mut roff = Roff::default();
    let item = |roff: &mut Roff, term: &str, text: &str| {
        roff.control("TP", [])
            .text([bold(term)])
            .text([roman(text)]);
    };
    roff.control("SH", ["CONFIGURATION FILE"]);
    roff.text([roman(
        "--config FILE reads flags from a TOML file. Each key is a flag's long name as \
         written on the command line, with dashes (kv-cache-budget = \"4GiB\", port = 8080, \
         no-prompt-cache = true). The command line wins over the environment variables \
         below, which win over the file. An unknown key or a value the flag refuses is an \
         error naming the file, the line and the key.",
    )]);
    roff.control("SH", ["ENVIRONMENT"]);
    item(
        &mut roff,
        "MLXCEL_CONFIG",
        "The config file, when --config is not given.",
    );
    item(
        &mut roff,
        "MLXCEL_MODEL, MLXCEL_HOST, MLXCEL_PORT, MLXCEL_API_KEY",
        "--model, --host, --port and --api-key.",
    );
    item(
        &mut roff,
        "HF_HOME",
        "The Hugging Face cache; hub models are read from and downloaded into HF_HOME/hub.",
    );
    item(
        &mut roff,
        "RUST_LOG",
        "Log filter (default info); logs go to standard error.",
    );
    roff.control("SH", ["SIGNALS AND EXIT STATUS"]);
    roff.text([roman(
        "SIGTERM and SIGINT stop the server: it stops accepting connections, lets open \
         requests finish for at most --shutdown-timeout seconds (then they fail with an \
         error), and exits with status 0. A second signal exits at once with status 1. \
         Errors (a model that cannot load, an address in use, a bad flag or config file) \
         exit with status 1 or 2.",
    )]);
    roff.control("SH", ["FILES"]);
    item(
        &mut roff,
        "/etc/mlxcel/server.toml",
        "The config file of the packaged mlxcel.service (a commented example of every flag).",
    );
    item(
        &mut roff,
        "/var/lib/mlxcel",
        "The service's state directory: models and the hub cache.",
    );
    item(
        &mut roff,
        "/usr/lib/mlxcel",
        "The MLX library the binaries were built against, and the libraries it bundles.",
    );
    roff
}

/// Bash, zsh and fish completions of `command`.
fn completions(command: &clap::Command, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    use clap_complete::Shell;
    let name = command.get_name().to_owned();
    let mut written = Vec::new();
    for (shell, sub, file) in [
        (Shell::Bash, "bash", name.clone()),
        (Shell::Zsh, "zsh", format!("_{name}")),
        (Shell::Fish, "fish", format!("{name}.fish")),
    ] {
        let shell_dir = dir.join(sub);
        std::fs::create_dir_all(&shell_dir)?;
        let path = shell_dir.join(file);
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        clap_complete::generate(shell, &mut command.clone(), name.clone(), &mut out);
        out.flush()?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn pages_and_completions_cover_every_flag() {
        let dir = std::env::temp_dir().join(format!("mlxcel-package-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let command = crate::ServerCli::command();
        let written = write(&dir, std::slice::from_ref(&command)).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.strip_prefix(&dir).unwrap().display().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "man/man1/mlxcel-server.1",
                "bash/mlxcel-server",
                "zsh/_mlxcel-server",
                "fish/mlxcel-server.fish"
            ]
        );
        let page = std::fs::read_to_string(dir.join("man/man1/mlxcel-server.1")).unwrap();
        assert_eq!(page.matches(".TH ").count(), 1, "{page}");
        assert!(page.contains(".TH mlxcel-server 1 "), "{page}");
        assert_eq!(page.matches(".ds Aq").count(), 2, "{page}");
        let bash = std::fs::read_to_string(dir.join("bash/mlxcel-server")).unwrap();
        let fish = std::fs::read_to_string(dir.join("fish/mlxcel-server.fish")).unwrap();
        for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
            let Some(long) = arg.get_long() else { continue };
            // roff escapes dashes.
            let escaped = format!("\\-\\-{}", long.replace('-', "\\-"));
            assert!(page.contains(&escaped), "the page lacks --{long}");
            assert!(bash.contains(&format!("--{long}")), "bash lacks --{long}");
            assert!(fish.contains(&format!("-l {long}")), "fish lacks --{long}");
        }
        assert!(page.contains(".SH \"SIGNALS AND EXIT STATUS\""), "{page}");
        assert!(page.contains("/etc/mlxcel/server.toml"), "{page}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

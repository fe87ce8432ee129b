//! The parts of the manual pages that clap does not know: other forms of a
//! command, FILES, ENVIRONMENT, EXIT STATUS, EXAMPLES and SEE ALSO.
//!
//! Every example is run by tests/examples.rs against the real binary, with
//! /run/vzram, /var/lib/vzram and /etc/vzram moved into a temporary
//! directory, on a daemon serving vm1 (8G, a backing file, --idle-after)
//! and vm2 (4G) for the commands that need one.

/// What a page adds to clap's sections.
pub struct Page {
    /// More SYNOPSIS lines.
    pub other_forms: &'static [&'static str],
    pub files: &'static [(&'static str, &'static str)],
    pub environment: &'static [(&'static str, &'static str)],
    /// A sentence, then the command lines (one or more).
    pub examples: &'static [(&'static str, &'static str)],
    pub see_also: &'static str,
}

pub const EXIT_STATUS: &[(&str, &str)] = &[
    ("0", "Success."),
    (
        "1",
        "A failure at run time: no daemon answers on the control socket, the daemon's own loop \
         or its launcher failed, a reply could not be read.",
    ),
    (
        "2",
        "Bad input, said on one line: an unknown flag or value, a configuration file that does \
         not parse, a request the daemon refuses (an unknown device, a device a VM is \
         connected to), or what serve finds wrong before serving (a socket path it cannot \
         bind, a port in use, a state that does not match). A start refused so leaves nothing \
         behind.",
    ),
];

const CLIENT_ENV: &[(&str, &str)] = &[
    (
        "VZRAM_CONTROL",
        "The control socket when --control is not given.",
    ),
    (
        "RUNTIME_DIRECTORY",
        "Without VZRAM_CONTROL: its control.sock (systemd's RuntimeDirectory=).",
    ),
    (
        "XDG_RUNTIME_DIR",
        "For a user other than root: $XDG_RUNTIME_DIR/vzram/control.sock \
         (/tmp/vzram-UID/control.sock without it); root's is /run/vzram/control.sock.",
    ),
];

const SERVE_ENV: &[(&str, &str)] = &[
    (
        "VZRAM_CONTROL",
        "The control socket when neither --control nor control in the file says.",
    ),
    (
        "VZRAM_STATE_DIR",
        "The state dir when neither --state-dir nor state_dir in the file says.",
    ),
    (
        "RUNTIME_DIRECTORY",
        "Set by systemd (RuntimeDirectory=): the control socket and state dir go there.",
    ),
    (
        "XDG_RUNTIME_DIR",
        "For a user other than root, where the control socket and the state dir go.",
    ),
    (
        "RUST_LOG",
        "When set, wins over --log-level and takes per-module filters (info,vzram_blk=debug).",
    ),
    (
        "NOTIFY_SOCKET, WATCHDOG_USEC",
        "Set by systemd for Type=notify: READY=1 once every device serves, STATUS= as \
         frontends come and go, STOPPING=1, and WATCHDOG=1 while the daemon is healthy.",
    ),
    (
        "LISTEN_FDS, LISTEN_PID",
        "Sockets passed by systemd's socket activation: each serves the device (or the \
         control socket) whose path it is bound to.",
    ),
    (
        "JOURNAL_STREAM",
        "stderr is the journal: text lines start with their syslog priority, no timestamp.",
    ),
];

const FILES: &[(&str, &str)] = &[
    (
        "/etc/vzram/vzram.toml",
        "The packaged configuration file (--config), described in vzram.toml(5).",
    ),
    (
        "/run/vzram/control.sock",
        "root's default control socket (a user's: $XDG_RUNTIME_DIR/vzram/control.sock).",
    ),
    (
        "/run/vzram/state/NAME/",
        "A device's state (header, table, arena, stats), root's default state dir; keep it on \
         tmpfs. A device without a name is keyed by its socket path (NAME-8 hex digits).",
    ),
    (
        "/usr/share/qemu/vhost-user/50-vzram.json",
        "QEMU's vhost-user backend descriptor: a management layer finds vzram by it.",
    ),
];

const CONFIG_FILES: &[(&str, &str)] = &[(
    "/etc/vzram/vzram.toml",
    "The file the packaged vzram.service passes to --config.",
)];

const SEE_ALSO_CLIENT: &str = "vzram(1), vzram-serve(1), vzram-stat(1), vzram.toml(5), zramctl(8)";

const DEFAULT: Page = Page {
    other_forms: &[],
    files: &[],
    environment: CLIENT_ENV,
    examples: &[],
    see_also: SEE_ALSO_CLIENT,
};

/// Paragraphs of vzram.toml(5)'s DESCRIPTION.
pub const CONFIG_DESCRIPTION: &[&str] = &[
    "vzram serve --config FILE reads its settings from a TOML file: the keys below at the top, \
     and one [[device]] table per device (a [device] table, or a key the daemon does not take, \
     is refused with the line it is on, exit 2). A key may be written with - or _. Flags on \
     the command line win over the file.",
    "Sizes are bytes or a number with a binary unit: 512M, 8G, 8Gi, 1.5G, 1T; a device's size \
     is a multiple of 4096, at most 64T. Durations: 90s, 10m, 1h, 1h30m. Modes are octal: \
     0o660 or \"0660\" (a decimal 660 is refused).",
    "On a reload (systemctl reload vzram, or vzram reload) devices added to the file are \
     served, devices gone from it stop serving (their state is kept, left over), and \
     mem_limit, host_mem_limit and host_staging are set; anything else that changed is logged as needing a \
     restart.",
];

/// The page named `name` (`vzram-serve`, `vzram.toml`).
pub fn page(name: &str) -> Page {
    match name {
        "vzram" => Page {
            other_forms: &[
                "vzram --socket-path PATH --size SIZE [SERVE OPTIONS]",
                "vzram --fd N --size SIZE [SERVE OPTIONS]",
                "vzram --print-capabilities",
            ],
            files: FILES,
            environment: SERVE_ENV,
            examples: &[
                (
                    "Serve one 8 GiB device; QEMU connects to its socket:",
                    "vzram serve --socket /run/vzram/vm1.sock --size 8G",
                ),
                ("What every device holds, and one device:", "vzram stat\nvzram stat vm1"),
                ("Cap a device's memory while it serves:", "vzram set-limit vm1 2G"),
                (
                    "Add a device to the running daemon, then remove it:",
                    "vzram add --device socket=/run/vzram/vm3.sock,size=4G,name=vm3\n\
                     vzram remove vm3",
                ),
                (
                    "QEMU's backend-program form, as a management layer starts it:",
                    "vzram --socket-path /run/vzram/vm1.sock --size 8G",
                ),
            ],
            see_also: "vzram-serve(1), vzram-stat(1), vzram-set-limit(1), vzram-add(1), \
                       vzram-remove(1), vzram-forget(1), vzram-migrate(1), vzram.toml(5), \
                       zramctl(8), qemu-storage-daemon(1), systemctl(1)",
        },
        "vzram-serve" => Page {
            other_forms: &[
                "vzram serve --config FILE",
                "vzram serve --device socket=PATH,size=SIZE[,KEY=VALUE...] ...",
            ],
            files: FILES,
            environment: SERVE_ENV,
            examples: &[
                (
                    "One 8 GiB device, its control socket named:",
                    "vzram serve --socket /run/vzram/vm1.sock --size 8G --control /run/vzram/control.sock",
                ),
                (
                    "Two devices in one process under a host-wide cap:",
                    "vzram serve --device socket=/run/vzram/vm1.sock,size=8G,mem-limit=2G \\\n  \
                     --device socket=/run/vzram/vm2.sock,size=4G,algo=zstd --host-mem-limit 4G",
                ),
                (
                    "The devices and settings of a file (vzram.toml(5)):",
                    "vzram serve --config /etc/vzram/vzram.toml",
                ),
                (
                    "Idle pages recompressed, then written to a backing file (it must exist):",
                    "truncate -s 16G /var/lib/vzram/vm1.img\n\
                     vzram serve --socket /run/vzram/vm1.sock --size 16G --mem-limit 2G \\\n  \
                     --backing-file /var/lib/vzram/vm1.img --idle-after 10m --auto-recompress --auto-writeback",
                ),
                (
                    "Prometheus metrics on loopback:",
                    "vzram serve --socket /run/vzram/vm1.sock --size 8G --metrics 127.0.0.1:9100",
                ),
            ],
            see_also: "vzram(1), vzram.toml(5), vzram-stat(1), qemu-storage-daemon(1), \
                       systemd.exec(5)",
        },
        "vzram.toml" => Page {
            other_forms: &[],
            files: CONFIG_FILES,
            environment: &[],
            examples: &[(
                "A daemon with one device that recompresses its idle pages and writes them back \
                 (the backing file must exist):",
                "host_mem_limit = \"16G\"\n\
                 socket_mode = 0o660\n\
                 metrics = \"127.0.0.1:9100\"\n\
                 \n\
                 [[device]]\n\
                 name = \"vm1\"\n\
                 socket = \"/run/vzram/vm1.sock\"\n\
                 size = \"8G\"\n\
                 mem_limit = \"4G\"\n\
                 algo = \"zstd:1\"\n\
                 backing_file = \"/var/lib/vzram/vm1.img\"\n\
                 idle_after = \"10m\"\n\
                 auto_writeback = true",
            )],
            see_also: "vzram(1), vzram-serve(1)",
        },
        "vzram-stat" => Page {
            examples: &[
                ("Every device, the pool and the left-over states:", "vzram stat"),
                ("One device, as JSON:", "vzram stat vm1 --json"),
                ("The devices' names, one a line (for scripts):", "vzram stat --names"),
            ],
            ..DEFAULT
        },
        "vzram-set-limit" => Page {
            examples: &[
                ("A device's limit, then the host's:", "vzram set-limit vm1 2G\nvzram set-limit --host 16G"),
                ("No limit:", "vzram set-limit vm1 0"),
            ],
            ..DEFAULT
        },
        "vzram-compact" => Page {
            examples: &[("Compact every device now:", "vzram compact")],
            ..DEFAULT
        },
        "vzram-add" => Page {
            examples: &[(
                "A 4 GiB device, served at once:",
                "vzram add --device socket=/run/vzram/vm3.sock,size=4G,name=vm3",
            )],
            ..DEFAULT
        },
        "vzram-remove" => Page {
            examples: &[
                ("Delete a device and its pages:", "vzram remove vm2"),
                (
                    "Also while a VM is connected: it is cut off and the pages are kept, left \
                     over (vzram add ...,recover=true serves them again):",
                    "vzram remove vm2 --force",
                ),
            ],
            ..DEFAULT
        },
        "vzram-forget" => Page {
            examples: &[
                ("The left-over states, by name:", "vzram stat --names=leftovers"),
                ("Every left-over whose socket's directory is gone:", "vzram forget --gone"),
                (
                    "Every left-over made for a socket that matches (a test run's):",
                    "vzram forget --socket '/tmp/qtest-*'",
                ),
            ],
            ..DEFAULT
        },
        "vzram-reload" => Page {
            examples: &[(
                "A daemon started from a file; after an edit of the file, apply it and \
                 see what changed (systemctl reload vzram does the same for the packaged \
                 unit):",
                "vzram serve --config /etc/vzram/vzram.toml\nvzram reload",
            )],
            ..DEFAULT
        },
        "vzram-reset" => Page {
            examples: &[("Drop a device's pages:", "vzram reset vm2")],
            ..DEFAULT
        },
        "vzram-reset-max" => Page {
            examples: &[("Restart mem_used_max everywhere:", "vzram reset-max")],
            ..DEFAULT
        },
        "vzram-mark-idle" => Page {
            examples: &[("Mark vm1's pages idle:", "vzram mark-idle vm1")],
            ..DEFAULT
        },
        "vzram-recompress" => Page {
            examples: &[(
                "Recompress the idle pages with zstd:",
                "vzram mark-idle vm1\nvzram recompress vm1 --idle --algo zstd:3",
            )],
            ..DEFAULT
        },
        "vzram-writeback" => Page {
            examples: &[(
                "Move at most 100000 idle pages to the backing file:",
                "vzram mark-idle vm1\nvzram writeback vm1 --idle --max-pages 100000",
            )],
            ..DEFAULT
        },
        "vzram-migrate" => Page {
            examples: &[
                (
                    "Send vm1 to the destination's incoming device while QEMU migrates the VM:",
                    "vzram migrate vm1 --to unix:/run/vzram/vm1.migrate",
                ),
                ("Call it off (QEMU's migration failed):", "vzram migrate vm1 --cancel"),
            ],
            ..DEFAULT
        },
        "vzram-backing-init" => Page {
            environment: &[],
            examples: &[(
                "Give up what a backing file holds, so another device may take it:",
                "truncate -s 4G /var/lib/vzram/vm2.img\nvzram backing init /var/lib/vzram/vm2.img",
            )],
            ..DEFAULT
        },
        "vzram-backing" => Page {
            environment: &[],
            ..DEFAULT
        },
        _ => DEFAULT,
    }
}

//! Unit tests of the files the published crates' examples and benches include,
//! kept here so that those copies carry no test code of their own.

mod results {
    use crate::results::*;

    #[test]
    fn a_section_is_written_with_its_command_and_machine_and_rewritten_in_place() {
        let dir = super::scratch_dir("results");
        let path = dir.join("RESULTS.md");
        write_section(&path, "x", "a", "cargo run -p x", "| a |\n");
        write_section(&path, "x", "b", "cargo run -p x -- b", "| b |\n");
        write_section(&path, "x", "a", "cargo run -p x", "| a2 |\n");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# x results\n"), "{text}");
        assert!(text.contains("`cargo run -p x`, on Linux "), "{text}");
        assert!(
            text.contains(&today()) && text.contains(&machine()),
            "{text}"
        );
        assert!(text.contains("| a2 |") && text.contains("| b |") && !text.contains("| a |"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_command_is_the_cargo_command_and_this_process_arguments() {
        let c = command("cargo test -p test-support");
        assert!(c.starts_with("cargo test -p test-support"), "{c}");
        assert!(!c.contains("--bench"));
        let d = today();
        assert_eq!((d.len(), &d[4..5], &d[7..8]), (10, "-", "-"), "{d}");
    }

    #[test]
    fn only_the_update_flag_asks_for_results_md() {
        let args = |a: &[&str]| {
            a.iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert!(update_asked(args(&["--runs", "3", "--update-results"])));
        assert!(!update_asked(args(&["--runs", "3", "--update"])));
        assert!(!update_asked(args(&[])));
        // This test process was not run with the flag: nothing is written.
        let dir = super::scratch_dir("results-unasked");
        let path = dir.join("RESULTS.md");
        write_section_if_asked(&path, "x", "a", "cargo run -p x", "| a |\n");
        assert!(!path.exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_section_is_replaced_in_place_and_others_are_kept() {
        let text = title("x");
        let one = replace_section(&text, "a", "first\n");
        let two = replace_section(&one, "b", "second\n");
        let again = replace_section(&two, "a", "third\n");
        assert!(again.starts_with("# x results\n"));
        assert!(again.contains("<!-- begin a -->\nthird\n<!-- end a -->\n"));
        assert!(again.contains("<!-- begin b -->\nsecond\n<!-- end b -->\n"));
        assert!(!again.contains("first"));
        assert!(again.find("begin a") < again.find("begin b"), "order kept");
    }

    #[test]
    fn dates_follow_the_calendar() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_788), (2026, 12, 1));
    }
}

mod criterion_medians {
    use crate::criterion_medians::*;

    #[test]
    fn medians_are_read_from_a_criterion_directory() {
        let dir = super::scratch_dir("criterion");
        let bench = dir.join("read_1 thread(s)/RcuCell__read/new");
        std::fs::create_dir_all(&bench).unwrap();
        std::fs::write(
            bench.join("estimates.json"),
            r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.5,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":0.8,"upper_bound":0.9},"point_estimate":0.87,"standard_error":0.01}}"#,
        )
        .unwrap();
        assert_eq!(
            median_ns_in(&dir, "read/1 thread(s)", "RcuCell::read"),
            Some(0.87)
        );
        assert_eq!(median_ns_in(&dir, "read/1 thread(s)", "Mutex::lock"), None);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn criterion_writes_under_the_target_directory_and_tests_measure_nothing() {
        // `cargo test` runs this with CARGO set, as `cargo bench` runs a bench.
        let dir = criterion_dir().expect("cargo metadata names the target directory");
        assert!(dir.ends_with("criterion"), "{}", dir.display());
        assert!(!measures_everything(), "a test run is not a bench run");
        assert_eq!(median_ns("no such group", "no such bench"), None);
    }

    #[test]
    fn names_become_directories_as_criterion_makes_them() {
        assert_eq!(filename_safe("read/1 thread(s)"), "read_1 thread(s)");
        assert_eq!(filename_safe("RcuCell::read"), "RcuCell__read");
    }
}

/// A fresh directory for one test.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("test-support-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

mod traces {
    use crate::traces::*;
    use std::time::Duration;

    #[test]
    fn a_trace_round_trips_and_a_bad_line_is_named() {
        let dir = super::scratch_dir("traces");
        let path = dir.join("host-x.trace");
        let values = [Duration::from_nanos(5), Duration::from_micros(3)];
        save(&path, "two values, ns", &values).unwrap();
        assert_eq!(load(&path).unwrap(), ("host-x".to_owned(), values.to_vec()));
        std::fs::write(&path, "# c\n7 # a comment\n\nx\n").unwrap();
        let e = load(&path).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.to_string().contains("host-x.trace:4"), "{e}");
    }

    #[test]
    fn a_table_has_its_heading_columns_and_rows() {
        let rows = [vec!["a".to_owned(), "1".to_owned()]];
        assert_eq!(
            table("**t** (1 run)", &["name", "n"], &rows),
            "**t** (1 run)\n\n| name | n |\n|---|---|\n| a | 1 |\n"
        );
    }

    #[test]
    fn the_random_source_repeats_from_its_seed_and_stays_in_range() {
        let (mut a, mut b) = (Rng(7), Rng(7));
        for _ in 0..1000 {
            let u = a.unit();
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u, b.unit());
        }
        assert!(a.uniform(2.0, 3.0) >= Duration::from_micros(2));
        assert!(a.exponential(1.0) < Duration::from_secs(1));
    }
}

mod summary {
    use crate::summary::*;

    #[test]
    fn the_median_is_the_upper_middle_and_nan_for_nothing() {
        assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(Vec::<f64>::new()).is_nan());
        assert_eq!(
            (quantile([5.0, 1.0], 0.0), quantile([5.0, 1.0], 1.0)),
            (1.0, 5.0)
        );
        assert_eq!(quantile((1..=101).map(f64::from), 0.99), 100.0);
    }
}

mod affinity {
    use crate::affinity::*;

    #[test]
    fn a_thread_pinned_to_an_allowed_cpu_runs_there_alone() {
        let cpu = allowed_cpus().unwrap()[0];
        std::thread::spawn(move || {
            pin_to(cpu).unwrap();
            assert_eq!(allowed_cpus().unwrap(), [cpu]);
            assert!(pin_to(libc::CPU_SETSIZE as usize).is_err());
        })
        .join()
        .unwrap();
    }
}

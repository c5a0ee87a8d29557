//! Unit tests of the files the published crates' examples and benches include,
//! kept here so that those copies carry no test code of their own.

mod results {
    use crate::results::*;

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
    fn the_median_is_read_from_criterions_estimates() {
        let json = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.5,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":0.8,"upper_bound":0.9},"point_estimate":0.87,"standard_error":0.01}}"#;
        assert_eq!(point_estimate(json, "median"), Some(0.87));
        assert_eq!(point_estimate(json, "mean"), Some(2.5));
        assert_eq!(point_estimate(json, "slope"), None);
    }

    #[test]
    fn names_become_directories_as_criterion_makes_them() {
        assert_eq!(filename_safe("read/1 thread(s)"), "read_1 thread(s)");
        assert_eq!(filename_safe("RcuCell::read"), "RcuCell__read");
        let meta = r#"{"packages":[],"target_directory":"/w/target","version":1}"#;
        assert_eq!(string_field(meta, "target_directory"), Some("/w/target"));
    }
}

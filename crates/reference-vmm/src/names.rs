//! A choice's names, for a command line or a configuration file: the
//! [`choice_names!`](crate::choice_names) macro gives an enum of plain
//! choices `FromStr`, `Display` and the list of its names, and a name that
//! names no choice is a [`ChoiceError`] that lists the ones it takes.
//! The VMM's own choices ([`Irqchip`],
//! [`TimerPlacement`]) have theirs here.

use crate::policies::{Irqchip, TimerPlacement};

/// A name that names no choice.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} {given:?} is not one of: {choices}")]
pub struct ChoiceError {
    /// What was being chosen.
    pub what: &'static str,
    /// What was given.
    pub given: String,
    /// What it takes, comma-separated.
    pub choices: String,
}

/// `FromStr`, `Display` and the list of names of a choice, whose variants
/// carry no data except an optional last one, named `NAME:VALUE`, whose
/// value parses with its own `FromStr`.
#[macro_export]
macro_rules! choice_names {
    ($t:ident, $what:literal, [$($variant:ident => $name:literal),+ $(,)?]
     $(, $param:ident($pty:ty) => $pname:literal ($phelp:literal))?) => {
        impl $t {
            /// Every choice without a value, in order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// Its name (without its value).
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                    $(Self::$param(_) => $pname,)?
                }
            }
        }

        impl ::std::str::FromStr for $t {
            type Err = $crate::ChoiceError;
            fn from_str(s: &str) -> Result<Self, $crate::ChoiceError> {
                $(
                    let value = s.strip_prefix(concat!($pname, ":")).map(str::parse::<$pty>);
                    if let Some(Ok(value)) = value {
                        return Ok(Self::$param(value));
                    }
                )?
                Self::ALL.iter().copied().find(|c| c.name() == s).ok_or_else(|| $crate::ChoiceError {
                    what: $what,
                    given: s.to_owned(),
                    choices: [$($name,)+ $(concat!($pname, ":", $phelp))?].join(", "),
                })
            }
        }

        impl ::std::fmt::Display for $t {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                match self {
                    $(Self::$param(value) => write!(f, "{}:{value}", $pname),)?
                    _ => f.write_str(self.name()),
                }
            }
        }
    };
}

choice_names!(Irqchip, "--irqchip", [User => "user", Kernel => "kernel"]);
choice_names!(TimerPlacement, "--timer-placement", [
    VcpuThread => "vcpu-thread", VcpuCpu => "vcpu-cpu", Anywhere => "anywhere",
]);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_name_parses_to_its_choice_and_others_are_refused_with_the_list() {
        for &i in Irqchip::ALL {
            assert_eq!(i.to_string().parse::<Irqchip>(), Ok(i));
        }
        for &p in TimerPlacement::ALL {
            assert_eq!(p.to_string().parse::<TimerPlacement>(), Ok(p));
        }
        let err = "cpu0".parse::<TimerPlacement>().unwrap_err().to_string();
        assert_eq!(
            err,
            "--timer-placement \"cpu0\" is not one of: vcpu-thread, vcpu-cpu, anywhere"
        );
        assert!("split".parse::<Irqchip>().is_err());
    }
}

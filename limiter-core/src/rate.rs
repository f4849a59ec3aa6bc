//! Rates (`100/s`) and durations (`10s`), kept as exact integers.

use std::fmt;
use std::num::NonZeroU64;

use crate::clock::{NANOS_PER_SEC, Nanos};

/// The largest amount a rate or limit may name: keeps every product of amounts,
/// periods and clock readings inside `u128` with room to spare.
pub const MAX_AMOUNT: u64 = 1_000_000_000_000;

/// The longest period or window: one year (365 days).
pub const MAX_PERIOD: Nanos = 365 * 86_400 * NANOS_PER_SEC;

/// `amount` units per `period` nanoseconds, exactly (no floating point).
///
/// # Examples
///
/// ```
/// use limiter_core::rate::Rate;
/// let r: Rate = "6000/m".parse().unwrap();
/// assert_eq!(r.amount().get(), 6000);
/// assert_eq!(r.period().get(), 60_000_000_000);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    amount: NonZeroU64,
    period: NonZeroU64,
}

impl Rate {
    /// A rate of `amount` per `period_ns` nanoseconds.
    ///
    /// # Errors
    ///
    /// When either is zero or above [`MAX_AMOUNT`] / [`MAX_PERIOD`].
    pub fn try_new(amount: u64, period_ns: Nanos) -> Result<Self, RateError> {
        let amount = NonZeroU64::new(amount).ok_or(RateError::Zero)?;
        let period = NonZeroU64::new(period_ns).ok_or(RateError::ZeroPeriod)?;
        if amount.get() > MAX_AMOUNT {
            return Err(RateError::TooLarge);
        }
        if period.get() > MAX_PERIOD {
            return Err(RateError::PeriodTooLong);
        }
        Ok(Self { amount, period })
    }

    /// Units per period.
    pub fn amount(&self) -> NonZeroU64 {
        self.amount
    }

    /// The period in nanoseconds.
    pub fn period(&self) -> NonZeroU64 {
        self.period
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.amount, DurationText(self.period.get()))
    }
}

/// Why a rate or duration text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    /// Not of the form `N/unit` or `N/<duration>`.
    #[error("expected a rate like `100/s`, `6000/m` or `50/10s`")]
    Malformed,
    /// Not of the form `<integer><unit>`.
    #[error("expected a duration like `500ms`, `10s`, `1m`, `1h` or `1d`")]
    MalformedDuration,
    /// The amount is zero.
    #[error("must be greater than zero")]
    Zero,
    /// The period or window is zero.
    #[error("the period must be greater than zero")]
    ZeroPeriod,
    /// The amount is above [`MAX_AMOUNT`].
    #[error("must be at most {MAX_AMOUNT}")]
    TooLarge,
    /// The period or window is above [`MAX_PERIOD`].
    #[error("must be at most 365d")]
    PeriodTooLong,
}

impl std::str::FromStr for Rate {
    type Err = RateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (amount, per) = s.trim().split_once('/').ok_or(RateError::Malformed)?;
        let amount: u64 = amount.trim().parse().map_err(|_| RateError::Malformed)?;
        let per = per.trim();
        // `100/s` means per one second; `50/10s` per ten seconds.
        let period = if per.starts_with(|c: char| c.is_ascii_digit()) {
            parse_duration(per)?
        } else {
            unit_nanos(per).ok_or(RateError::Malformed)?
        };
        Self::try_new(amount, period)
    }
}

fn unit_nanos(unit: &str) -> Option<Nanos> {
    Some(match unit {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" | "sec" | "second" => NANOS_PER_SEC,
        "m" | "min" | "minute" => 60 * NANOS_PER_SEC,
        "h" | "hour" => 3_600 * NANOS_PER_SEC,
        "d" | "day" => 86_400 * NANOS_PER_SEC,
        _ => return None,
    })
}

/// Parses a duration like `250ms`, `10s`, `1m`, `1h`, `1d` into nanoseconds.
///
/// # Errors
///
/// A missing number or unit, an unknown unit, zero, or more than a year.
///
/// # Examples
///
/// ```
/// assert_eq!(limiter_core::rate::parse_duration("1m"), Ok(60_000_000_000));
/// ```
pub fn parse_duration(s: &str) -> Result<Nanos, RateError> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).ok_or(RateError::MalformedDuration)?;
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| RateError::MalformedDuration)?;
    let unit = unit_nanos(unit.trim()).ok_or(RateError::MalformedDuration)?;
    let total = n.checked_mul(unit).ok_or(RateError::PeriodTooLong)?;
    if total == 0 {
        return Err(RateError::ZeroPeriod);
    }
    if total > MAX_PERIOD {
        return Err(RateError::PeriodTooLong);
    }
    Ok(total)
}

/// Displays nanoseconds in the largest whole unit (`1m`, `1500ms`).
#[derive(Debug, Clone, Copy)]
pub struct DurationText(pub Nanos);

impl fmt::Display for DurationText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(Nanos, &str); 7] = [
            (86_400 * NANOS_PER_SEC, "d"),
            (3_600 * NANOS_PER_SEC, "h"),
            (60 * NANOS_PER_SEC, "m"),
            (NANOS_PER_SEC, "s"),
            (1_000_000, "ms"),
            (1_000, "us"),
            (1, "ns"),
        ];
        let n = self.0;
        let (size, unit) = UNITS
            .iter()
            .copied()
            .find(|(size, _)| n.is_multiple_of(*size) && n >= *size)
            .unwrap_or((1, "ns"));
        write!(f, "{}{unit}", n / size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_in_every_unit() {
        let r: Rate = "100/s".parse().unwrap();
        assert_eq!((r.amount().get(), r.period().get()), (100, NANOS_PER_SEC));
        let r: Rate = "50/10s".parse().unwrap();
        assert_eq!((r.amount().get(), r.period().get()), (50, 10 * NANOS_PER_SEC));
        let r: Rate = "1/h".parse().unwrap();
        assert_eq!(r.period().get(), 3_600 * NANOS_PER_SEC);
        assert_eq!(r.to_string(), "1/1h");
    }

    #[test]
    fn refuses_bad_rates() {
        assert_eq!("0/s".parse::<Rate>(), Err(RateError::Zero));
        assert_eq!("-1/s".parse::<Rate>(), Err(RateError::Malformed));
        assert_eq!("10/fortnight".parse::<Rate>(), Err(RateError::Malformed));
        assert_eq!("10".parse::<Rate>(), Err(RateError::Malformed));
        assert_eq!("1.5/s".parse::<Rate>(), Err(RateError::Malformed));
        assert_eq!("10/0s".parse::<Rate>(), Err(RateError::ZeroPeriod));
    }

    #[test]
    fn parses_and_refuses_durations() {
        assert_eq!(parse_duration("250ms"), Ok(250_000_000));
        assert_eq!(parse_duration("1d"), Ok(86_400 * NANOS_PER_SEC));
        assert_eq!(parse_duration("10"), Err(RateError::MalformedDuration));
        assert_eq!(parse_duration("s"), Err(RateError::MalformedDuration));
        assert_eq!(parse_duration("0s"), Err(RateError::ZeroPeriod));
        assert_eq!(parse_duration("400d"), Err(RateError::PeriodTooLong));
        assert_eq!(DurationText(1_500_000_000).to_string(), "1500ms");
    }
}

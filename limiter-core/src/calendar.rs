//! Calendar windows: days, weeks, months and years as a timezone's calendar has them.
//!
//! A window of `fixed_window` or `sliding_counter` is either a fixed length aligned on
//! the Unix epoch, or (with `align: calendar`) a run of `count` calendar units that
//! starts at local midnight in an IANA timezone: a day of 23 or 25 hours across a
//! daylight-saving switch, a month of 28 to 31 days, a week from the configured first
//! day. Timezone rules come from the tz database bundled into the binary (`jiff`), so
//! a fresh machine needs no system tzdata.
//!
//! The boundaries of the window a decision falls in are cached per rule: a decision
//! reads them from a sequence-locked record (plain loads, no lock) and recomputes
//! them only when time has left the cached window, once per window per process.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use jiff::Timestamp;
use jiff::civil::{Date, DateTime};
use jiff::tz::TimeZone;
use parking_lot::Mutex;

use crate::clock::Nanos;

/// A calendar unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// A local day, midnight to midnight.
    Day,
    /// Seven local days from the configured first day of the week.
    Week,
    /// A month, from local midnight on the 1st.
    Month,
    /// A year, from local midnight on the 1st of January.
    Year,
}

impl CalendarUnit {
    /// The unit as written in a policy (`1d`, `1w`, `1mo`, `1y`).
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Day => "d",
            Self::Week => "w",
            Self::Month => "mo",
            Self::Year => "y",
        }
    }

    /// The most units of this kind one window may span (a window is at most a year).
    pub fn max_count(self) -> u32 {
        match self {
            Self::Day => 366,
            Self::Week => 52,
            Self::Month => 12,
            Self::Year => 1,
        }
    }

    /// Parses a calendar duration (`1d`, `2w`, `1mo`, `3mo`, `1y`) into count and unit.
    pub fn parse(text: &str) -> Option<(u32, Self)> {
        let text = text.trim();
        let split = text.find(|c: char| !c.is_ascii_digit())?;
        let (digits, unit) = text.split_at(split);
        let count: u32 = digits.parse().ok()?;
        let unit = match unit.trim() {
            "d" | "day" => Self::Day,
            "w" | "week" => Self::Week,
            "mo" | "month" => Self::Month,
            "y" | "year" => Self::Year,
            _ => return None,
        };
        Some((count, unit))
    }
}

/// The first day of a week, Monday by default (ISO 8601).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeekStart {
    /// Monday.
    #[default]
    Monday,
    /// Tuesday.
    Tuesday,
    /// Wednesday.
    Wednesday,
    /// Thursday.
    Thursday,
    /// Friday.
    Friday,
    /// Saturday.
    Saturday,
    /// Sunday.
    Sunday,
}

impl WeekStart {
    /// Every day, Monday first.
    pub const ALL: [Self; 7] = [
        Self::Monday,
        Self::Tuesday,
        Self::Wednesday,
        Self::Thursday,
        Self::Friday,
        Self::Saturday,
        Self::Sunday,
    ];

    /// The day's name in a policy (`monday`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Monday => "monday",
            Self::Tuesday => "tuesday",
            Self::Wednesday => "wednesday",
            Self::Thursday => "thursday",
            Self::Friday => "friday",
            Self::Saturday => "saturday",
            Self::Sunday => "sunday",
        }
    }

    fn days_after_monday(self) -> i64 {
        match self {
            Self::Monday => 0,
            Self::Tuesday => 1,
            Self::Wednesday => 2,
            Self::Thursday => 3,
            Self::Friday => 4,
            Self::Saturday => 5,
            Self::Sunday => 6,
        }
    }
}

/// Why a calendar window cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CalendarError {
    /// The timezone is not in the bundled tz database.
    #[error("unknown timezone; expected an IANA name like `Europe/Berlin` or `UTC`")]
    UnknownTimezone,
    /// Zero units, or more than a year.
    #[error("a calendar window is 1 to {most} {unit} units")]
    Count {
        /// The unit's suffix.
        unit: &'static str,
        /// The most allowed.
        most: u32,
    },
    /// Too many distinct calendar windows in one process.
    #[error("more than {MAX_RULES} distinct calendar windows (timezone, unit, count, week start)")]
    TooMany,
}

/// The most distinct calendar rules a process keeps (each is built once and kept for
/// the process's life, so reloads reuse them).
pub const MAX_RULES: usize = 4_096;

/// Shifts window numbers so that windows before 1970 in a timezone west of UTC still
/// number above zero (a state's window 0 is a fresh state's).
const INDEX_OFFSET: i64 = 1 << 32;

/// One calendar window rule, built once and shared: `Calendar` is a copyable handle.
struct Rule {
    unit: CalendarUnit,
    count: i64,
    week_start: WeekStart,
    zone_name: Box<str>,
    zone: TimeZone,
    cache: Cache,
}

/// A calendar window rule: `count` units of `unit` in a timezone. Copy, compared and
/// hashed by identity (rules are interned, so equal settings are the same rule).
#[derive(Clone, Copy)]
pub struct Calendar(&'static Rule);

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Calendar {}

impl std::hash::Hash for Calendar {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        std::ptr::hash(self.0, state);
    }
}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Calendar({self})")
    }
}

impl fmt::Display for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.0;
        write!(f, "{}{} calendar in {}", r.count, r.unit.suffix(), r.zone_name)?;
        if r.unit == CalendarUnit::Week && r.week_start != WeekStart::Monday {
            write!(f, " from {}", r.week_start.as_str())?;
        }
        Ok(())
    }
}

static RULES: Mutex<Vec<&'static Rule>> = Mutex::new(Vec::new());

impl Calendar {
    /// The rule for `count` units of `unit` in the timezone named `zone` (an IANA
    /// name), weeks starting on `week_start`.
    ///
    /// # Errors
    ///
    /// An unknown timezone, a count of zero or beyond a year, or more than
    /// [`MAX_RULES`] distinct rules in this process.
    ///
    /// # Examples
    ///
    /// ```
    /// use limiter_core::calendar::{Calendar, CalendarUnit, WeekStart};
    /// let month = Calendar::try_new(CalendarUnit::Month, 1, "Europe/Berlin", WeekStart::Monday)
    ///     .unwrap();
    /// // 2026-03-15T12:00:00Z is in March, which in Berlin starts 2026-02-28T23:00:00Z.
    /// let span = month.span(1_773_576_000_000_000_000);
    /// assert_eq!(span.start, 1_772_319_600_000_000_000);
    /// assert_eq!(span.len, 31 * 86_400_000_000_000 - 3_600_000_000_000); // DST on the 29th
    /// ```
    pub fn try_new(
        unit: CalendarUnit,
        count: u32,
        zone: &str,
        week_start: WeekStart,
    ) -> Result<Self, CalendarError> {
        if count == 0 || count > unit.max_count() {
            return Err(CalendarError::Count { unit: unit.suffix(), most: unit.max_count() });
        }
        // The week start only matters for weeks: one rule for every other unit.
        let week_start = if unit == CalendarUnit::Week { week_start } else { WeekStart::Monday };
        let mut rules = RULES.lock();
        if let Some(r) = rules.iter().find(|r| {
            r.unit == unit
                && r.count == i64::from(count)
                && r.week_start == week_start
                && &*r.zone_name == zone
        }) {
            return Ok(Self(r));
        }
        if rules.len() >= MAX_RULES {
            return Err(CalendarError::TooMany);
        }
        let tz = TimeZone::get(zone).map_err(|_| CalendarError::UnknownTimezone)?;
        let rule: &'static Rule = Box::leak(Box::new(Rule {
            unit,
            count: i64::from(count),
            week_start,
            zone_name: zone.into(),
            zone: tz,
            cache: Cache::default(),
        }));
        rules.push(rule);
        Ok(Self(rule))
    }

    /// The unit.
    pub fn unit(&self) -> CalendarUnit {
        self.0.unit
    }

    /// Units per window.
    pub fn count(&self) -> u32 {
        u32::try_from(self.0.count).unwrap_or(u32::MAX)
    }

    /// The timezone's IANA name.
    pub fn zone_name(&self) -> &str {
        &self.0.zone_name
    }

    /// The first day of a week.
    pub fn week_start(&self) -> WeekStart {
        self.0.week_start
    }

    /// A typical window's length (a month as 30 days, a year as 365): for display
    /// and sizing only, never for a boundary.
    pub fn nominal(&self) -> Nanos {
        const DAY: Nanos = 86_400_000_000_000;
        let days: Nanos = match self.0.unit {
            CalendarUnit::Day => 1,
            CalendarUnit::Week => 7,
            CalendarUnit::Month => 30,
            CalendarUnit::Year => 365,
        };
        days * DAY * Nanos::from(self.count())
    }

    /// The starts of six consecutive windows, `now`'s the third: what the Redis
    /// store's script is given, so that Redis's own clock may fall a window either
    /// side of the server's and still find its window and both neighbours.
    pub fn starts_around(&self, now: Nanos) -> [Nanos; 6] {
        let k = self.0.number(now);
        [k - 2, k - 1, k, k + 1, k + 2, k + 3].map(|i| self.0.start_clamped(i))
    }

    /// The window `now` falls in, with its neighbours' lengths.
    #[inline]
    pub fn span(&self, now: Nanos) -> Span {
        if let Some(s) = self.0.cache.read(now) {
            return s;
        }
        let s = self.0.compute(now);
        self.0.cache.write(s);
        s
    }
}

/// The window an instant falls in, with the lengths of the windows either side (a
/// sliding counter weighs the previous one by its real length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The window's number: consecutive windows have consecutive numbers.
    pub index: u64,
    /// Its first instant.
    pub start: Nanos,
    /// Its length.
    pub len: Nanos,
    /// The previous window's length.
    pub prev_len: Nanos,
    /// The next window's length.
    pub next_len: Nanos,
}

impl Span {
    /// The first instant after the window.
    #[inline]
    pub fn end(&self) -> Nanos {
        self.start.saturating_add(self.len)
    }

    /// The window a fixed length `w` aligned on the epoch gives `now`.
    #[inline]
    pub fn fixed(now: Nanos, w: Nanos) -> Self {
        let index = now / w;
        Self { index, start: index * w, len: w, prev_len: w, next_len: w }
    }
}

impl Rule {
    /// The window's number of the calendar unit holding local date `d`.
    fn unit_number(&self, d: Date) -> i64 {
        match self.unit {
            CalendarUnit::Day => days_from_civil(d),
            // 1970-01-01 was a Thursday: three days after Monday.
            CalendarUnit::Week => {
                (days_from_civil(d) + 3 - self.week_start.days_after_monday()).div_euclid(7)
            }
            CalendarUnit::Month => i64::from(d.year()) * 12 + i64::from(d.month()) - 1,
            CalendarUnit::Year => i64::from(d.year()),
        }
    }

    /// The local date window `k` starts on.
    fn first_date(&self, k: i64) -> Option<Date> {
        let u = k.checked_mul(self.count)?;
        match self.unit {
            CalendarUnit::Day => civil_from_days(u),
            CalendarUnit::Week => civil_from_days(u * 7 - 3 + self.week_start.days_after_monday()),
            CalendarUnit::Month => {
                Date::new(i16::try_from(u.div_euclid(12)).ok()?, (u.rem_euclid(12) + 1) as i8, 1)
                    .ok()
            }
            CalendarUnit::Year => Date::new(i16::try_from(u).ok()?, 1, 1).ok(),
        }
    }

    /// The instant window `k` starts: its first local midnight (in a gap, the first
    /// instant after it).
    fn start_of(&self, k: i64) -> i128 {
        let Some(date) = self.first_date(k) else { return if k < 0 { 0 } else { i128::MAX } };
        let midnight = DateTime::from_parts(date, jiff::civil::Time::midnight());
        self.zone
            .to_ambiguous_timestamp(midnight)
            .compatible()
            .map_or(if k < 0 { 0 } else { i128::MAX }, Timestamp::as_nanosecond)
    }

    /// The number of the window holding `now`.
    fn number(&self, now: Nanos) -> i64 {
        let ts = Timestamp::from_nanosecond(i128::from(now)).unwrap_or(Timestamp::MAX);
        let local = self.zone.to_datetime(ts);
        let mut k = self.unit_number(local.date()).div_euclid(self.count);
        // Midnight in a fold or gap could put `now` a window off its date's; step.
        for _ in 0..2 {
            if i128::from(now) < self.start_of(k) {
                k -= 1;
            } else if i128::from(now) >= self.start_of(k + 1) {
                k += 1;
            }
        }
        k
    }

    fn start_clamped(&self, k: i64) -> Nanos {
        u64::try_from(self.start_of(k).max(0)).unwrap_or(u64::MAX)
    }

    fn compute(&self, now: Nanos) -> Span {
        let k = self.number(now);
        let [p, s, e, n] = [k - 1, k, k + 1, k + 2].map(|i| self.start_clamped(i));
        Span {
            index: u64::try_from(k + INDEX_OFFSET).unwrap_or(0),
            start: s,
            len: e.saturating_sub(s).max(1),
            prev_len: s.saturating_sub(p).max(1),
            next_len: n.saturating_sub(e).max(1),
        }
    }
}

/// Days from 1970-01-01 to a civil date (proleptic Gregorian).
fn days_from_civil(d: Date) -> i64 {
    let (y, m, day) = (i64::from(d.year()), i64::from(d.month()), i64::from(d.day()));
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date `days` after 1970-01-01.
fn civil_from_days(days: i64) -> Option<Date> {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    Date::new(i16::try_from(y).ok()?, i8::try_from(m).ok()?, i8::try_from(d).ok()?).ok()
}

/// The last window computed, behind a sequence lock: readers load the fields and
/// check that the sequence did not move (odd: a write under way), so a read is a
/// handful of plain loads on every core; a writer takes the sequence to odd with a
/// compare-and-swap, so writers never interleave.
#[derive(Default)]
struct Cache {
    seq: AtomicU64,
    index: AtomicU64,
    start: AtomicU64,
    len: AtomicU64,
    prev_len: AtomicU64,
    next_len: AtomicU64,
}

impl Cache {
    #[inline]
    fn read(&self, now: Nanos) -> Option<Span> {
        let s1 = self.seq.load(Ordering::Acquire);
        if s1 == 0 || s1 % 2 == 1 {
            return None;
        }
        let span = Span {
            index: self.index.load(Ordering::Relaxed),
            start: self.start.load(Ordering::Relaxed),
            len: self.len.load(Ordering::Relaxed),
            prev_len: self.prev_len.load(Ordering::Relaxed),
            next_len: self.next_len.load(Ordering::Relaxed),
        };
        // Orders the field loads before the second load of the sequence: a writer
        // that began meanwhile has moved it.
        fence(Ordering::Acquire);
        if self.seq.load(Ordering::Relaxed) != s1 {
            return None;
        }
        (span.start <= now && now < span.end()).then_some(span)
    }

    fn write(&self, span: Span) {
        let s = self.seq.load(Ordering::Relaxed);
        // Keep the latest window: an old instant (a refund of an earlier grant) must
        // not evict the one every decision reads.
        if s % 2 == 1 || (s != 0 && self.start.load(Ordering::Relaxed) > span.start) {
            return;
        }
        if self.seq.compare_exchange(s, s + 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return;
        }
        // The odd sequence is visible before any field changes.
        fence(Ordering::Release);
        self.index.store(span.index, Ordering::Relaxed);
        self.start.store(span.start, Ordering::Relaxed);
        self.len.store(span.len, Ordering::Relaxed);
        self.prev_len.store(span.prev_len, Ordering::Relaxed);
        self.next_len.store(span.next_len, Ordering::Relaxed);
        self.seq.store(s + 2, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: Nanos = 3_600_000_000_000;
    const DAY: Nanos = 24 * H;

    fn at(text: &str) -> Nanos {
        let ts: Timestamp = text.parse().unwrap();
        u64::try_from(ts.as_nanosecond()).unwrap()
    }

    #[test]
    fn civil_days_round_trip() {
        for days in -800_000..800_000i64 {
            if days % 7 != 0 {
                continue;
            }
            let d = civil_from_days(days).unwrap();
            assert_eq!(days_from_civil(d), days);
        }
        assert_eq!(days_from_civil(Date::new(1970, 1, 1).unwrap()), 0);
        assert_eq!(days_from_civil(Date::new(2000, 3, 1).unwrap()), 11_017);
    }

    #[test]
    fn days_across_daylight_saving_are_23_and_25_hours() {
        let day =
            Calendar::try_new(CalendarUnit::Day, 1, "Europe/Berlin", WeekStart::Monday).unwrap();
        // 2026-03-29: clocks go forward at 02:00 local.
        let spring = day.span(at("2026-03-29T12:00:00Z"));
        assert_eq!(spring.start, at("2026-03-28T23:00:00Z"));
        assert_eq!(spring.len, 23 * H);
        assert_eq!(spring.prev_len, DAY);
        // 2026-10-25: back at 03:00 local.
        let autumn = day.span(at("2026-10-25T12:00:00Z"));
        assert_eq!(autumn.start, at("2026-10-24T22:00:00Z"));
        assert_eq!(autumn.len, 25 * H);
        assert_eq!(autumn.next_len, DAY);
        let next = day.span(autumn.end());
        assert_eq!(next.index, autumn.index + 1);
        assert_eq!(next.prev_len, 25 * H);
    }

    #[test]
    fn months_weeks_and_years_start_at_local_midnight() {
        let month = Calendar::try_new(CalendarUnit::Month, 1, "UTC", WeekStart::Monday).unwrap();
        let feb = month.span(at("2024-02-29T23:59:59Z"));
        assert_eq!((feb.start, feb.len), (at("2024-02-01T00:00:00Z"), 29 * DAY));
        assert_eq!((feb.prev_len, feb.next_len), (31 * DAY, 31 * DAY));
        let quarter = Calendar::try_new(CalendarUnit::Month, 3, "UTC", WeekStart::Monday).unwrap();
        assert_eq!(quarter.span(at("2026-05-10T00:00:00Z")).start, at("2026-04-01T00:00:00Z"));
        let week = Calendar::try_new(CalendarUnit::Week, 1, "UTC", WeekStart::Monday).unwrap();
        // 2026-12-02 is a Wednesday.
        assert_eq!(week.span(at("2026-12-02T10:00:00Z")).start, at("2026-11-30T00:00:00Z"));
        let sunday = Calendar::try_new(CalendarUnit::Week, 1, "UTC", WeekStart::Sunday).unwrap();
        assert_eq!(sunday.span(at("2026-12-02T10:00:00Z")).start, at("2026-11-29T00:00:00Z"));
        let year =
            Calendar::try_new(CalendarUnit::Year, 1, "Asia/Kolkata", WeekStart::Monday).unwrap();
        let y = year.span(at("2027-01-01T00:00:00Z"));
        assert_eq!(y.start, at("2026-12-31T18:30:00Z"));
        assert_eq!(y.len, 365 * DAY);
    }

    #[test]
    fn rules_are_interned_and_checked() {
        let a = Calendar::try_new(CalendarUnit::Day, 2, "UTC", WeekStart::Monday).unwrap();
        let b = Calendar::try_new(CalendarUnit::Day, 2, "UTC", WeekStart::Sunday).unwrap();
        assert_eq!(a, b, "the week start does not matter for days");
        assert!(matches!(
            Calendar::try_new(CalendarUnit::Month, 13, "UTC", WeekStart::Monday),
            Err(CalendarError::Count { .. })
        ));
        assert_eq!(
            Calendar::try_new(CalendarUnit::Day, 1, "Mars/Olympus", WeekStart::Monday),
            Err(CalendarError::UnknownTimezone)
        );
        assert_eq!(a.to_string(), "2d calendar in UTC");
    }

    #[test]
    fn the_cache_serves_its_window_and_keeps_the_latest() {
        let day =
            Calendar::try_new(CalendarUnit::Day, 1, "Australia/Sydney", WeekStart::Monday).unwrap();
        let now = at("2026-06-01T05:00:00Z");
        let s = day.span(now);
        assert_eq!(day.0.cache.read(now), Some(s));
        // An older instant is computed, not cached over the newer window.
        let old = day.span(now - 3 * DAY);
        assert_eq!(old.index + 3, s.index);
        assert_eq!(day.0.cache.read(now), Some(s));
        assert_eq!(day.0.cache.read(now - 3 * DAY), None);
    }
}

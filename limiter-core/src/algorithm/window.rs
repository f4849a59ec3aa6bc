//! A window of `fixed_window` and `sliding_counter`: a fixed length aligned on the
//! Unix epoch, or a calendar window (see [`crate::calendar`]).

use std::fmt;
use std::num::NonZeroU64;

use crate::calendar::{Calendar, Span};
use crate::clock::Nanos;
use crate::rate::DurationText;

/// How a window algorithm cuts time into windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Window {
    /// `[k*W, (k+1)*W)` in nanoseconds since the Unix epoch.
    Fixed(NonZeroU64),
    /// Calendar units in a timezone.
    Calendar(Calendar),
}

impl Window {
    /// The window `now` falls in.
    #[inline]
    pub fn span(&self, now: Nanos) -> Span {
        match self {
            Self::Fixed(w) => Span::fixed(now, w.get()),
            Self::Calendar(c) => c.span(now),
        }
    }

    /// The number of the window `t` falls in, given the span of a later instant:
    /// `None` for a window before the one preceding `later` (nothing counts there
    /// any more), so an old instant never needs a calendar look-up.
    #[inline]
    pub(crate) fn index_near(&self, later: &Span, t: Nanos) -> Option<u64> {
        if t >= later.start {
            Some(later.index)
        } else if t >= later.start.saturating_sub(later.prev_len) {
            later.index.checked_sub(1)
        } else {
            None
        }
    }

    /// The number of the latest window a state written up to `skew` after `now`
    /// could belong to. A calendar window looks up only `now`'s window (a look-up of
    /// a later instant would displace the one every decision reads from the cache).
    #[inline]
    pub(crate) fn latest_index(&self, now: Nanos, skew: Nanos) -> u64 {
        match self {
            Self::Fixed(w) => now.saturating_add(skew) / w.get(),
            Self::Calendar(c) => {
                let span = c.span(now);
                span.index + u64::from(now.saturating_add(skew) >= span.end())
            }
        }
    }

    /// A typical window's length: the window itself when fixed, a calendar window's
    /// nominal length (a month as 30 days) otherwise. Never used for a boundary.
    pub fn nominal(&self) -> Nanos {
        match self {
            Self::Fixed(w) => w.get(),
            Self::Calendar(c) => c.nominal(),
        }
    }

    /// The calendar rule, when the window is one.
    pub fn calendar(&self) -> Option<Calendar> {
        match self {
            Self::Fixed(_) => None,
            Self::Calendar(c) => Some(*c),
        }
    }
}

impl From<NonZeroU64> for Window {
    fn from(w: NonZeroU64) -> Self {
        Self::Fixed(w)
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(w) => DurationText(w.get()).fmt(f),
            Self::Calendar(c) => c.fmt(f),
        }
    }
}

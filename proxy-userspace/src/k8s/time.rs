//! Timestamps as Kubernetes writes them (RFC 3339): parsed from annotations, formatted for `/healthz`
//! and `kproxy trace`. One path for both directions.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Parses the RFC 3339 timestamps Kubernetes writes (`2026-11-29T14:00:00Z`,
/// optionally with fractional seconds and a numeric offset).
pub fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let bytes = text.as_bytes();
    let num = |range: std::ops::Range<usize>| -> Option<i64> { text.get(range)?.parse().ok() };
    if bytes.len() < 20 || bytes[4] != b'-' || bytes[7] != b'-' || !matches!(bytes[10], b'T' | b't') {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut rest = &text[19..];
    let mut nanos = 0u32;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        let padded = format!("{:0<9}", &frac[..digits.min(9)]);
        nanos = padded.parse().ok()?;
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6 && matches!(&rest[..1], "+" | "-") => {
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            sign * (rest[1..3].parse::<i64>().ok()? * 3600 + rest[4..6].parse::<i64>().ok()? * 60)
        }
        _ => return None,
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset;
    let secs = u64::try_from(secs).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Format a time as RFC 3339 in UTC, e.g. `2023-11-14T22:13:20Z`, with the
/// fraction of a second only when non-zero and without trailing zeros (like
/// Go's `time.RFC3339Nano`).
pub fn rfc3339(time: SystemTime) -> String {
    let nanos: i128 = match time.duration_since(UNIX_EPOCH) {
        Ok(since) => since.as_nanos() as i128,
        Err(before) => -(before.duration().as_nanos() as i128),
    };
    let secs = nanos.div_euclid(1_000_000_000) as i64;
    let subsec = nanos.rem_euclid(1_000_000_000) as u32;
    let days = secs.div_euclid(86_400);
    let of_day = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let mut out = format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    );
    if subsec != 0 {
        let fraction = format!("{subsec:09}");
        out.push('.');
        out.push_str(fraction.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Proleptic Gregorian (year, month, day) of a day count since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365], March-based
    let mp = (5 * doy + 2) / 153; // [0, 11]
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn rfc3339_known_timestamps() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(at(951_782_400)), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(at(951_868_799)), "2000-02-29T23:59:59Z");
        assert_eq!(rfc3339(at(951_868_800)), "2000-03-01T00:00:00Z");
        assert_eq!(rfc3339(at(1_234_567_890)), "2009-02-13T23:31:30Z");
        assert_eq!(rfc3339(at(1_700_000_000)), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(at(1_709_251_199)), "2024-02-29T23:59:59Z");
        assert_eq!(rfc3339(at(4_102_444_799)), "2099-12-31T23:59:59Z");
        assert_eq!(rfc3339(at(4_107_542_400)), "2100-03-01T00:00:00Z");
        assert_eq!(rfc3339(at(253_402_300_799)), "9999-12-31T23:59:59Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_nanos(1_700_000_000_500_000_000)),
            "2023-11-14T22:13:20.5Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_nanos(1_000_000_123)),
            "1970-01-01T00:00:01.000000123Z"
        );
        assert_eq!(rfc3339(UNIX_EPOCH - Duration::from_secs(1)), "1969-12-31T23:59:59Z");
        assert_eq!(rfc3339(UNIX_EPOCH - Duration::from_millis(1500)), "1969-12-31T23:59:58.5Z");
        assert_eq!(rfc3339(UNIX_EPOCH - Duration::from_secs(86_400 * 365)), "1969-01-01T00:00:00Z");
    }

    #[test]
    fn rfc3339_timestamps_as_kubernetes_writes_them() {
        let at = |s| parse_rfc3339(s).map(|t| t.duration_since(SystemTime::UNIX_EPOCH).unwrap());
        assert_eq!(at("1970-01-01T00:00:00Z"), Some(Duration::ZERO));
        assert_eq!(at("2026-11-29T14:00:00Z"), Some(Duration::from_secs(1_795_960_800)));
        assert_eq!(at("2026-11-29T14:00:00.25Z"), Some(Duration::new(1_795_960_800, 250_000_000)));
        assert_eq!(at("2026-11-29T15:00:00+01:00"), Some(Duration::from_secs(1_795_960_800)));
        assert_eq!(at("2000-02-29T00:00:00Z"), Some(Duration::from_secs(951_782_400)));
        assert_eq!(at("2026-13-01T00:00:00Z"), None);
        assert_eq!(at("yesterday"), None);
        assert_eq!(at("2026-11-29 14:00:00Z"), None);
    }

    #[test]
    fn civil_from_days_round_trips_every_day_over_eight_centuries() {
        // Walk day by day from 1600-03-01 and compare with a naive calendar.
        let mut days = -135_080; // 1600-03-01
        let (mut y, mut m, mut d) = (1600_i64, 3_u32, 1_u32);
        let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        while y < 2400 {
            assert_eq!(civil_from_days(days), (y, m, d), "day {days}");
            let month_len = match m {
                2 if leap(y) => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            days += 1;
            d += 1;
            if d > month_len {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
        }
    }
}

-- lib.lua: exact integer helpers shared by the algorithm scripts.
--
-- Redis runs Lua 5.1, whose numbers are doubles: integers are exact below 2^53.
-- Every quantity the scripts keep stays below 2^52 (the server refuses limits whose
-- parameters could leave that range), and these helpers never round: a quotient
-- from floating division is corrected by one step when it lands on the wrong side.
--
-- KEYS, ARGV, return shape and time source: see chain.lua, the entry point these
-- files are composed in front of (lib, the four algorithms, then chain).

local TWO52 = 4503599627370496

-- The most units a level of `capacity` holds charged at once, debt included: ten
-- allowances beyond its limit, as limiter-core's MAX_DEBT_ALLOWANCES, so a charge
-- past the limit (a cost reported above its estimate) is a bounded wait.
local function max_charged(capacity)
  return math.min(capacity * 11, TWO52)
end

-- floor(x / y) for integers x >= 0, y > 0.
local function idiv(x, y)
  local q = math.floor(x / y)
  if q * y > x then
    q = q - 1
  elseif (q + 1) * y <= x then
    q = q + 1
  end
  return q
end

-- ceil(x / y) for integers x >= 0, y > 0.
local function cdiv(x, y)
  local q = idiv(x, y)
  if q * y < x then q = q + 1 end
  return q
end

-- a * b = q * c + r (0 <= r < c), exactly, even when a * b is past 2^53 (c below
-- 2^52): long multiplication bit by bit, the remainder kept below c.
local function muldivmod(a, b, c)
  if a * b < TWO52 then
    local q = idiv(a * b, c)
    return q, a * b - q * c
  end
  local qa = idiv(a, c)
  local ra = a - qa * c
  local bits, x = {}, b
  while x > 0 do
    local h = idiv(x, 2)
    bits[#bits + 1] = x - 2 * h
    x = h
  end
  local q, r = 0, 0
  for i = #bits, 1, -1 do
    q, r = q * 2, r * 2
    if r >= c then q, r = q + 1, r - c end
    if bits[i] == 1 then
      q, r = q + qa, r + ra
      if r >= c then q, r = q + 1, r - c end
    end
  end
  return q, r
end

-- floor(a * b / c) exactly.
local function muldiv(a, b, c)
  return (muldivmod(a, b, c))
end

-- ceil(a * b / c) exactly.
local function cmuldiv(a, b, c)
  local q, r = muldivmod(a, b, c)
  if r > 0 then q = q + 1 end
  return q
end

-- An integer as Redis wants it in a key, a member or a score ("%.0f": tostring
-- would write 1.7e+15).
local function int(x)
  return string.format('%.0f', x)
end

-- Sets a key's TTL to `ttl_us` (at least 1 ms), stretched by up to a tenth so that
-- keys written together do not all expire in the same instant.
local function expire_in(key, ttl_us, now)
  local ms = cdiv(math.max(ttl_us, 1), 1000)
  local spread = math.max(1, idiv(ms, 10))
  redis.call('PEXPIRE', key, ms + (now % 997) % spread + 1)
end

-- The window holding `now`, set on the level: lv.index (the window's number; a
-- calendar window's is its start), lv.prev_index, lv.start, lv.len, lv.prev_len and
-- lv.next_len. A fixed window is lv.p2 microseconds aligned on the epoch. A calendar
-- window (lv.starts) is one of the windows whose six consecutive starts the server
-- passed, computed from its own clock with the server's window third: Redis's clock
-- (the time source) must fall in the second, third or fourth window, so both
-- neighbours are known; further off, the call fails (a store error) rather than
-- guess a boundary.
local function window_span(lv, now)
  local s = lv.starts
  if s then
    for j = 2, 4 do
      if s[j] <= now and now < s[j + 1] then
        lv.index, lv.prev_index = s[j], s[j - 1]
        lv.start, lv.len = s[j], s[j + 1] - s[j]
        lv.prev_len, lv.next_len = s[j] - s[j - 1], s[j + 2] - s[j + 1]
        return
      end
    end
    error('redis time ' .. int(now) .. ' is outside the calendar windows the server sent')
  end
  local w = lv.p2
  lv.index = idiv(now, w)
  lv.prev_index = lv.index - 1
  lv.start = lv.index * w
  lv.len, lv.prev_len, lv.next_len = w, w, w
end

-- Which window an instant at or before the current window falls in: 0 the current
-- one, 1 the previous one, nil an older one (nothing of it counts any more).
local function window_of(lv, t)
  if t >= lv.start then return 0 end
  if t >= lv.start - lv.prev_len then return 1 end
  return nil
end

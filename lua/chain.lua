-- chain.lua: the entry point. Checks and charges the whole chain of one request's
-- limits (outermost level first) all-or-nothing in one atomic call. The script Redis
-- runs is lib.lua, the four algorithm files and this one, joined in that order.
--
-- KEYS: each level's keys in order (one for most algorithms, two for a sliding log).
--   Every key of one call shares one hash tag, so the call works on Redis Cluster.
-- ARGV[1]: op, one of
--   decide        ARGV[3] cost, ARGV[4] dry run (1) or not (0)
--   charge        ARGV[3] units (usage reported after the fact: charged even past
--                 the limit, as a debt)
--   refund        ARGV[3] units, ARGV[4] granted at (us), ARGV[5] hold (us): gives
--                 back units of a decision or grant made then
--   grant         ARGV[3] most units, ARGV[4] hold asked for (us), ARGV[5] need: with
--                 need 0, the most every level can give (up to the most asked); with
--                 need > 0, nothing unless every level has `need`, and then at most
--                 half of what is left (at least `need`), so a batch held by one
--                 node strands at most half of the rest; ARGV[6..8] a previous
--                 grant's unspent units, grant time and hold, returned first
--   lease         ARGV[3] the holder's cap (what it asked for within the route's
--                 max_batch and its demand over the hold), ARGV[4] hold asked for
--                 (us), ARGV[5] the waiting request's cost (0: none), ARGV[6..8] the
--                 previous lease's unspent units, grant time and hold, returned
--                 first, ARGV[9] active holders of the chain (0: a node's slice,
--                 never direct), ARGV[10] what the other active holders asked for in
--                 all, ARGV[11] a random draw below 2^32, ARGV[12] the least
--                 grant the holder can use (0: any): one renewal in one call,
--                 sized by the owner's grant rule (limiter-core's
--                 `lease::grant_size`: the cap while what is left covers every ask,
--                 else a part in proportion to the asks, its fraction paid with its
--                 probability; within half of what is left; at least the cost;
--                 nothing if less than the least);
--                 direct mode when the tightest capacity is less than two costs per
--                 active holder; nothing when the cost does not fit
--   remaining     nothing
--   inspect       nothing: reads every level, saves nothing
-- ARGV[2]: now in microseconds, or -1 for Redis TIME (the default; tests pass fixed
--   times to replay golden cases).
-- ARGV[13..]: per level its kind and parameters (see the algorithm's file): four
--   for tb, fw, sl and sc (the kind and three numbers); eight for the calendar
--   windows cw and cc (the kind, the limit and six window starts).
-- Returns an array of integers (times in microseconds):
--   decide     {1, tightest level (1-based, 0: none), remaining, reset after, now}
--              {0, failing level (outermost), retry after (longest), 0, now}
--   grant      {units, granted at, hold, binding level (0: none), then after the
--              grant: units left at the tightest level, that level, its reset after;
--              then, when `need` did not fit: the outermost level refusing it and
--              the longest wait (as decide answers), else 0, 0}
--   lease      {1, units, granted at, hold, binding level (0: none)} for a grant;
--              {2, 0, now, hold, 0} in direct mode (too little for the active
--              holders); {0, 0, now, hold, 0} when the cost did not fit
--   remaining  {units left at the tightest level}
--   inspect    {remaining, reset after} per level in order, then now
--   others     {0}
-- Time: redis.call('TIME') (Redis 7 replicates a script's effects, not the script, so
--   reading the clock is allowed), one reading for the whole call.

local algorithms = {
  tb = token_bucket, fw = fixed_window, sl = sliding_log, sc = sliding_counter,
  cw = fixed_window, cc = sliding_counter,
}
local calendar = { cw = true, cc = true }

local now = tonumber(ARGV[2])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local levels = {}
local k = 1
local i = 13
while ARGV[i] do
  local algo = algorithms[ARGV[i]]
  if not algo then return redis.error_reply('unknown algorithm ' .. ARGV[i]) end
  local lv = {
    algo = algo, key = KEYS[k], log = KEYS[k + 1],
    p1 = tonumber(ARGV[i + 1]), p2 = tonumber(ARGV[i + 2]), p3 = tonumber(ARGV[i + 3]),
  }
  local width = 4
  if calendar[ARGV[i]] then
    lv.starts = {}
    for j = 1, 6 do lv.starts[j] = tonumber(ARGV[i + 1 + j]) end
    width = 8
  end
  k = k + algo.keys
  algo.load(lv, now)
  levels[#levels + 1] = lv
  i = i + width
end

local function save_all()
  for _, lv in ipairs(levels) do
    if lv.dirty then lv.algo.save(lv, now) end
  end
end

local function min_remaining()
  local least, at = -1, 0
  for n, lv in ipairs(levels) do
    local r = lv.algo.remaining(lv, now)
    if least < 0 or r < least then least, at = r, n end
  end
  return least, at
end

local function refund_all(units, granted_at, hold)
  if units <= 0 then return end
  for _, lv in ipairs(levels) do
    lv.algo.refund(lv, now, lv.algo.stamp(lv, granted_at, hold), units)
  end
end

local op = ARGV[1]
local a1, a2, a3 = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])

if op == 'decide' then
  local cost, dry = a1, a2 == 1
  local tight, tight_left, failed, wait = 0, -1, 0, 0
  for n, lv in ipairs(levels) do
    local r = lv.algo.remaining(lv, now)
    if cost <= r then
      local left = r - cost
      if dry then left = r end
      if tight == 0 or left < tight_left then tight, tight_left = n, left end
    else
      local w = lv.algo.retry_after(lv, now, math.min(cost, lv.algo.capacity(lv)))
      if failed == 0 then failed = n end
      wait = math.max(wait, w)
    end
  end
  if failed > 0 then
    save_all()
    return { 0, failed, wait, 0, now }
  end
  if not dry and cost > 0 then
    for _, lv in ipairs(levels) do lv.algo.charge(lv, now, now, cost) end
  end
  local reset = 0
  if tight > 0 then reset = levels[tight].algo.reset_after(levels[tight], now) end
  save_all()
  return { 1, tight, tight_left, reset, now }
elseif op == 'charge' then
  if a1 > 0 then
    for _, lv in ipairs(levels) do lv.algo.charge(lv, now, now, a1) end
  end
  save_all()
  return { 0 }
elseif op == 'refund' then
  refund_all(a1, a2, a3)
  save_all()
  return { 0 }
elseif op == 'grant' then
  refund_all(tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
  local hold = a2
  for _, lv in ipairs(levels) do hold = lv.algo.hold(lv, now, hold) end
  local units, binding = a1, 0
  for n, lv in ipairs(levels) do
    local r = lv.algo.remaining(lv, now)
    if r < units then units, binding = r, n end
  end
  local failed, wait = 0, 0
  if a3 > 0 then
    local left = min_remaining()
    if left < a3 then
      -- Not even `need`: the request waiting for this grant is refused here, as
      -- decide would refuse it (outermost failing level, longest wait).
      units = 0
      for n, lv in ipairs(levels) do
        if lv.algo.remaining(lv, now) < a3 then
          if failed == 0 then failed = n end
          local cost = math.min(a3, lv.algo.capacity(lv))
          wait = math.max(wait, lv.algo.retry_after(lv, now, cost))
        end
      end
    else
      units = math.max(a3, math.min(units, idiv(left, 2)))
    end
  end
  if units > 0 then
    for _, lv in ipairs(levels) do
      lv.algo.charge(lv, now, lv.algo.stamp(lv, now, hold), units)
    end
  end
  local left, tight = min_remaining()
  local reset = 0
  if tight > 0 then reset = levels[tight].algo.reset_after(levels[tight], now) end
  save_all()
  return { units, now, hold, binding, left, tight, reset, failed, wait }
elseif op == 'lease' then
  refund_all(tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
  local cap, cost, active = a1, a3, tonumber(ARGV[9])
  local hold = a2
  for _, lv in ipairs(levels) do hold = lv.algo.hold(lv, now, hold) end
  local left, tight = min_remaining()
  local capacity = -1
  for _, lv in ipairs(levels) do
    local c = lv.algo.capacity(lv)
    if capacity < 0 or c < capacity then capacity = c end
  end
  if active > 0 and capacity < math.max(cost, 1) * active * 2 then
    save_all()
    return { 2, 0, now, hold, 0 }
  end
  local fair = cap
  local total = cap + tonumber(ARGV[10])
  if total > left then
    local exact = left * cap
    fair = idiv(exact, total)
    local part = exact - fair * total
    if idiv(tonumber(ARGV[11]) * total, 4294967296) < part then fair = fair + 1 end
  end
  local share = math.min(fair, idiv(left, 2))
  local units = math.min(math.max(cost, share), left)
  if units < tonumber(ARGV[12]) then units = 0 end
  if units == 0 or units < cost then
    save_all()
    return { 0, 0, now, hold, 0 }
  end
  for _, lv in ipairs(levels) do
    lv.algo.charge(lv, now, lv.algo.stamp(lv, now, hold), units)
  end
  local binding = 0
  if units < cap then binding = tight end
  save_all()
  return { 1, units, now, hold, binding }
elseif op == 'remaining' then
  local left = min_remaining()
  save_all()
  return { left }
elseif op == 'inspect' then
  -- Reads only: nothing is saved, so no key is created or refreshed.
  local out = {}
  for _, lv in ipairs(levels) do
    out[#out + 1] = lv.algo.remaining(lv, now)
    out[#out + 1] = lv.algo.reset_after(lv, now)
  end
  out[#out + 1] = now
  return out
end
return redis.error_reply('unknown op ' .. tostring(op))
